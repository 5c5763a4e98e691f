"""3D with PyTorch's APIs, run from the course: ``d2lpar/examples/threed_torch.py`` (torch only) on
ranks started by the course's launcher, as torchrun would start them.

The script builds ``init_device_mesh(device, (dp, pp, tp))``, cuts each stage's blocks with
``parallelize_module``, shards every layer with ``fully_shard`` over dp and runs ``Schedule1F1B``
over pp. ``run_torch_3d`` hands it the course's model and batches (``--state``: a file it reads) and
returns the losses, the rebuilt state dict, the first step's gradients (before the optimizer) and
the step times, to compare with one device and with
``hand.run_3d``.
"""

from __future__ import annotations

import os
import runpy
from dataclasses import dataclass
from pathlib import Path

import torch

from d2lpar.infra.paths import build_dir
from d2lpar.processes.launch import launch
from d2lpar.strategies.threed.gpt import gpt_sizes

__all__ = ["run_torch_3d", "TorchThreeD", "SCRIPT"]

# run as a script file (as torchrun runs it), not imported: the examples sit above the strategies
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "threed_torch.py"


@dataclass
class TorchThreeD:
    losses: list[float]
    state: dict[str, torch.Tensor]
    step_times: list[float]   # per step, the slowest rank's seconds
    grads: dict[str, torch.Tensor]   # the first step's gradients, whole, before the optimizer step
    copies_differ: float = 0.0   # the largest difference of any rank's (whole) copy from ``state``


def run_torch_3d(model, batches, dp: int = 2, tp: int = 2, pp: int = 2, microbatches: int = 2,
                 lr: float = 3e-3, timeout: float = 180.0) -> TorchThreeD:
    z = gpt_sizes(model)
    path = os.path.join(build_dir("threed"), f"state_{os.getpid()}.pt")
    torch.save({"model": model.state_dict(), "batches": list(batches)}, path)
    argv = ["--dp", dp, "--tp", tp, "--pp", pp, "--microbatches", microbatches, "--layers", z["layers"],
            "--heads", z["heads"], "--d", z["d"], "--seq", z["seq"], "--lr", lr, "--state", path, "--cpu"]
    try:
        main = runpy.run_path(str(SCRIPT), run_name="threed_torch_script")["main"]
        results = launch(main, dp * tp * pp, [str(a) for a in argv],
                         init_process_group=False, timeout=timeout)
    finally:
        os.remove(path)
    state, grads = {}, {}
    for r in results:
        state.update(r["state"])
        grads.update(r["grads"])
    copies_differ = max(float((v - state[k]).abs().max()) for r in results for k, v in r["state"].items())
    losses = next(r["losses"] for r in results if r["losses"])
    steps = [max(r["seconds"][k] for r in results) for k in range(len(results[0]["seconds"]))]
    return TorchThreeD(losses, state, steps, grads, copies_differ)
