"""The torch-only scripts run under torchrun where torch has no numpy (``pip install torch`` brings
none).

torch unpickles an object it receives from another rank with ``tensor.numpy()``
(``_tensor_to_object`` in ``torch/distributed/distributed_c10d.py``), so every object collective
(``all_gather_object``, ``recv_object_list``, ...) fails there with "Numpy is not available": the
scripts' own, ``PipelineStage``'s shape inference when it is given no shapes, and ``dcp.save`` /
``dcp.load`` when they agree on a plan across ranks. The scripts avoid all three.

One real torchrun launch (``python -m torch.distributed.run --standalone --nproc-per-node=2``),
with a folder first on PYTHONPATH whose ``numpy`` fails to import as a missing one does: each
worker (``tests/numpy_hidden.py``) proves that its torch has no numpy (``import numpy``,
``Tensor.numpy()`` and ``torch.from_numpy`` fail), shows that ``all_gather_object`` fails there,
then runs every torch-only script that runs on CPUs, one after another, with small arguments:
pipeline_torch (1F1B), threed_torch (pp 2), fsdp_tp_torch (saved on dp 1 x tp 2, resumed on
dp 2 x tp 1), ddp_torch's check that no two ranks share a GPU (on faked GPU ids), memory_torch,
debug_torch, ddp_torch and loss_log_torch (tensor parallel: DTensor and plain gradients in one
norm, the loss summed over a data-parallel group of one). A torchrun start costs 5-9 s here, so one launch of 2 ranks serves them
all (2 ranks reach every path that sends objects: a stage's neighbour, DCP's plan, the gather).
That each script equals one process is tested elsewhere (tests/test_pipeline_torch.py,
test_threed.py, test_fsdp_tp_torch.py, test_examples_torch_only.py, with numpy); checked here:
each run finished, and the resumed FSDP2 x TP checkpoint, written and read on different grids
without numpy, equals one process's 4 steps. context_parallel_torch needs CUDA; a check of every
torch-only file's source (no object collective, PipelineStage given its shapes, DCP without plan
exchange) covers it and any script added later. Cost here (2 cores, a load of 6-7 when measured):
14-24 s, the launch 13-19 s of it (rank 0's steps add up to ~10 s: it prints them); the source
checks, 0.1 s.
"""

import ast
import json
import os
import re
import runpy
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from d2lpar.processes.commands import REPO, leftovers, run
from tests.numpy_hidden import hide_numpy, numpy_signs
from tests.test_examples_torch_only import torch_only_scripts

EXAMPLES = REPO / "d2lpar" / "examples"
OBJECT_COLLECTIVES = {"all_gather_object", "gather_object", "broadcast_object_list",
                      "scatter_object_list", "send_object_list", "recv_object_list"}
HIDDEN = "numpy hidden: import numpy fails, Tensor.numpy() fails, torch.from_numpy fails"


def sends_objects(source: str) -> list[str]:
    """The calls in ``source`` that make torch send pickled objects between ranks: an object
    collective, a ``PipelineStage`` without ``input_args`` and ``output_args``, ``dcp.save``
    without ``use_collectives=False``, ``dcp.load`` without ``no_dist=True``, and
    ``broadcast_from_rank0=True`` (``set_state_dict``'s broadcast of the keys)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        given = {k.arg: getattr(k.value, "value", k.value) for k in node.keywords}
        shapes = {"input_args", "output_args"} <= set(given)
        if name.split(".")[-1] in OBJECT_COLLECTIVES \
                or (name.endswith("PipelineStage") and not shapes) \
                or (name == "dcp.save" and given.get("use_collectives") is not False) \
                or (name == "dcp.load" and given.get("no_dist") is not True) \
                or given.get("broadcast_from_rank0") is True:
            found.append(f"line {node.lineno}: {name}")
    return found


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    assert leftovers() == [], "a launcher or worker outlived its test"


def test_the_checks_can_fail():
    assert len(numpy_signs()) == 0  # this process has numpy: none of the three signs
    planted = ("dist.all_gather_object(out, x)\nPipelineStage(m, 0, 2, dev, input_args=x)\n"
               "dcp.save(s, checkpoint_id=d)\ndcp.load(s, checkpoint_id=d, no_dist=n)\n"
               "set_state_dict(m, o, options=StateDictOptions(broadcast_from_rank0=True))\n")
    assert sends_objects(planted) == ["line 1: dist.all_gather_object", "line 2: PipelineStage",
                                      "line 3: dcp.save", "line 4: dcp.load",
                                      "line 5: StateDictOptions"]
    assert sends_objects("PipelineStage(m, 0, 2, dev, input_args=x, output_args=y)\n"
                         "dcp.save(s, use_collectives=False)\ndcp.load(s, no_dist=True)\n") == []


@pytest.mark.parametrize("script", torch_only_scripts(), ids=lambda p: p.name)
def test_no_torch_only_script_sends_objects(script):
    assert sends_objects(script.read_text()) == [], f"{script.name} would need numpy"


def test_torch_only_scripts_under_torchrun_without_numpy(tmp_path):
    def main(name: str, *argv: str) -> dict:
        return {"run": "main", "script": str(EXAMPLES / f"{name}.py"), "argv": list(argv)}

    plan = [{"run": "object_collective"},  # what fails here: the scripts send no object
            main("pipeline_torch", "--schedule", "1F1B", "--layers", "2", "--batch-size", "8",
                 "--microbatches", "2", "--steps", "2"),
            main("threed_torch", "--pp", "2", "--layers", "2", "--d", "32", "--heads", "4",
                 "--seq", "16", "--batch-size", "4", "--steps", "2"),
            main("fsdp_tp_torch", "--out", "ckpt", "--steps", "2"),  # dp 1 x tp 2: steps 1-2
            main("fsdp_tp_torch", "--out", "ckpt", "--tp", "1"),  # dp 2 x tp 1: resumes, 3-4
            {"run": "shared_gpu_check", "script": str(EXAMPLES / "ddp_torch.py")},
            main("memory_torch", "--steps", "2"),
            main("debug_torch"),
            main("ddp_torch", "--out", "ddp", "--epochs", "1", "--examples", "256",
                 "--batch-size", "32"),
            main("loss_log_torch", "train", "--layout", "tp", "--out", "tp.jsonl", "--steps", "2")]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    hide = hide_numpy(tmp_path / "hide")
    path = os.pathsep.join(p for p in (str(hide), os.environ.get("PYTHONPATH")) if p)
    job = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               REPO / "tests" / "numpy_hidden.py", tmp_path / "plan.json"],
              timeout=150, env={"PYTHONPATH": path}, cwd=tmp_path)
    out, seconds = job.text(), job.seconds
    for rank in (0, 1):
        assert f"rank {rank}: {HIDDEN}" in out
        assert f"rank {rank}: step 0 (object_collective) done in" in out
        for step in range(1, len(plan)):
            assert re.search(f"rank {rank}: step {step} .* done in", out), f"{rank}: step {step}"
    assert out.count("all_gather_object fails: Numpy is not available") == 2  # the old way fails
    assert "rank 1 of 2 (1F1B, cpu): step 2, loss" in out
    assert "dp 1 x tp 1 x pp 2 on cpu: losses" in out
    assert "rank 0 of 2 (dp 1 x tp 2, cpu): step 2," in out
    assert "rank 0 of 2 (dp 2 x tp 1, cpu): step 3," in out  # resumed after step 2
    assert "rank 0 of 2 (dp 2 x tp 1, cpu): step 1," not in out
    assert out.count("['ok', \"ranks 0 and 1 were given the same GPU (GPU-0): start one") == 2
    assert "rank 1: step 2, loss" in out and out.count("finished") >= 2
    assert "rank 0 of 2 (cpu): epoch 1" in out
    assert "rank 0 of 2 (tp, cpu): step 2, loss" in out
    assert len((tmp_path / "tp.jsonl").read_text().splitlines()) == 2   # rank 0 logged both steps

    fsdp = runpy.run_path(str(EXAMPLES / "fsdp_tp_torch.py"), run_name="one_process")
    fsdp["main"](["--out", str(tmp_path / "one"), "--cpu"])  # steps 1-4 in one process
    start = fsdp["make_data_and_model"](0)[1].state_dict()
    resumed, one = (_weights(start, tmp_path / d) for d in ("ckpt", "one"))
    for name, value in one.items():
        assert (value - start[name]).abs().max() > 1e-2, f"{name} did not move"
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-5, msg=name)
    print(f"torchrun, 2 ranks, {len(plan)} steps without numpy: {seconds:.1f} s; rank 0's steps:")
    print("\n".join(re.findall(r"rank 0: step \d+ \(.*\) done in [\d.]+ s", out)))


def _weights(like: dict, folder) -> dict:
    """A DCP checkpoint's model weights, read whole in this process."""
    state = {"model": {k: torch.empty_like(v) for k, v in like.items()}}
    with warnings.catch_warnings():  # "no process group: loading in a single process" (meant)
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state["model"]
