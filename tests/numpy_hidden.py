"""What each torchrun worker of tests/test_examples_without_numpy.py runs, with numpy hidden: it
proves that numpy is out of reach, shows that an object collective fails here, then runs the plan's
steps one after another (a torch-only script's ``main(argv)``, or ddp_torch's check that no two
ranks share a GPU, on faked GPU ids). Imports nothing from d2lpar.

Each step gets a rendezvous of its own: rank 0 picks a free port and posts it in torchrun's own
store (the agent's, at MASTER_ADDR:MASTER_PORT); every rank points MASTER_PORT there, with
TORCHELASTIC_USE_AGENT_STORE off, so rank 0 hosts that step's store. A process group made again on
the agent's store would meet the keys the last one left there under the same names.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/numpy_hidden.py PLAN.json
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

NUMPY_FAILS = "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n"


def hide_numpy(folder: Path) -> Path:
    """A folder to put first on PYTHONPATH: its ``numpy`` package fails to import as a missing one
    does, so torch starts as in a venv where ``pip install torch`` brought no numpy."""
    (folder / "numpy").mkdir(parents=True, exist_ok=True)
    (folder / "numpy" / "__init__.py").write_text(NUMPY_FAILS)
    return folder


def numpy_signs() -> list[str]:
    """What shows that numpy is out of reach of this process and of its torch (all three, or fewer
    where numpy is there)."""
    import torch
    signs = []
    try:
        import numpy  # noqa: F401
    except ModuleNotFoundError:
        signs.append("import numpy fails")
    for what, call in (("Tensor.numpy()", lambda: torch.zeros(1).numpy()),
                       ("torch.from_numpy", lambda: torch.from_numpy(None))):
        try:
            call()
        except (RuntimeError, TypeError) as e:  # with numpy: TypeError, None is no array
            if "Numpy is not available" in str(e):
                signs.append(f"{what} fails")
    return signs


def object_collective() -> str:
    """What ``all_gather_object`` does here (torch unpickles what it receives with numpy)."""
    import torch.distributed as dist
    out: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, dist.get_rank())
    except RuntimeError as e:
        return f"all_gather_object fails: {e}"
    return f"all_gather_object works: {out}"


def shared_gpu_check(script: str) -> list[str]:
    """ddp_torch's check_one_gpu_each on faked GPU ids: every rank its own, then all on GPU-0."""
    import torch
    import torch.distributed as dist
    names = runpy.run_path(script, run_name="torch_only_script")
    real = torch.cuda.get_device_properties
    said = []
    try:
        for uuid in (f"GPU-{dist.get_rank()}", "GPU-0"):
            torch.cuda.get_device_properties = lambda device, u=uuid: type("P", (), {"uuid": u})
            try:
                names["check_one_gpu_each"](torch.device("cuda", 0), dist.get_world_size())
                said.append("ok")
            except names["Usage"] as e:
                said.append(str(e))
    finally:
        torch.cuda.get_device_properties = real
    return said


def in_a_group(step: dict):
    """A step that needs a process group: made here, gone after."""
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        return object_collective() if step["run"] == "object_collective" \
            else shared_gpu_check(step["script"])
    finally:
        dist.destroy_process_group()


def fresh_rendezvous(agent, key: str, rank: int) -> None:
    """Point MASTER_PORT at a port rank 0 found free, for a store rank 0 will host."""
    if rank == 0:
        with socket.socket() as s:
            s.bind((os.environ["MASTER_ADDR"], 0))
            agent.set(key, str(s.getsockname()[1]))
    os.environ["MASTER_PORT"] = agent.get(key).decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def main(plan_file: str) -> None:
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    print(f"rank {rank}: numpy hidden: {', '.join(numpy_signs())}", flush=True)
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    for i, step in enumerate(json.loads(Path(plan_file).read_text())):
        fresh_rendezvous(agent, f"numpy_hidden_step_{i}", rank)
        t0 = time.perf_counter()
        said = None
        if step["run"] == "main":  # the script prints what it has to say
            runpy.run_path(step["script"], run_name="torch_only_script")["main"](step["argv"])
        else:
            said = in_a_group(step)
        what = Path(step.get("script", step["run"])).name
        print(f"rank {rank}: step {i} ({what}) done in {time.perf_counter() - t0:.1f} s"
              + (f": {said}" if said is not None else ""), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
