"""d2lpar.processes.checkpoint: atomic saves survive a kill mid-save; loads are weights_only; mismatches are clear."""

import os
import signal
import sys
import textwrap

import pytest
import torch
from torch import nn

from d2lpar.processes import checkpoint
from d2lpar.processes.checkpoint import CheckpointError
from d2lpar.processes.commands import start
from d2lpar.infra.models import lenet, mlp


def test_round_trip_restores_model_optimizer_and_epoch(tmp_path):
    model = lenet(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    opt.step()
    path = checkpoint.save(checkpoint.training_state(model, opt, epoch=3, note="x"), tmp_path / "last.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left behind

    fresh = lenet(seed=2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    start_epoch, state = checkpoint.resume(path, fresh, fresh_opt)
    assert start_epoch == 4 and state["note"] == "x"
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    buf = lambda o: [s["momentum_buffer"] for s in o.state_dict()["state"].values()]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(buf(opt), buf(fresh_opt)))


def test_resume_without_a_file_starts_at_epoch_0(tmp_path):
    assert checkpoint.resume(tmp_path / "none.pt", mlp((4, 2))) == (0, None)


def test_ddp_wrapper_is_unwrapped_and_module_prefix_is_explained(tmp_path):
    model = mlp((4, 3, 2))
    wrapped = nn.DataParallel(model)  # same .module convention as DDP, no process group needed
    state = checkpoint.training_state(wrapped)
    assert not any(k.startswith("module.") for k in state["model"])
    with pytest.raises(CheckpointError, match="saved from the DDP wrapper"):
        checkpoint.restore(wrapped.state_dict(), mlp((4, 3, 2)))


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    path = checkpoint.save(checkpoint.training_state(mlp((4, 8, 2))), tmp_path / "a.pt")
    with pytest.raises(CheckpointError, match="from another model.*other shapes"):
        checkpoint.resume(path, mlp((4, 16, 2)))
    with pytest.raises(CheckpointError, match="from another model.*missing"):
        checkpoint.resume(path, lenet())


def test_load_maps_to_the_requested_device(tmp_path):
    path = checkpoint.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    out = checkpoint.load(path, map_location=torch.device("cpu"))
    assert out["w"].device.type == "cpu"


def test_weights_only_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"obj": os.getcwd, "w": torch.ones(1)}, path)  # a pickled function
    with pytest.raises(CheckpointError, match="weights_only") as err:
        checkpoint.load(path)
    assert "posix.getcwd" in str(err.value)   # what it refused ...
    assert "weights_only=False" not in str(err.value) and err.value.__cause__ is None   # ... no advice to run it


def test_a_damaged_file_is_named_without_torchs_advice_to_load_it_unsafely(tmp_path):
    path = tmp_path / "noise.pt"
    path.write_bytes(b"\x80\x02garbage" * 8)   # a pickle header, then damage
    with pytest.raises(CheckpointError, match=r"noise.pt is not a loadable checkpoint \(.+\)") as err:
        checkpoint.load(path)
    assert "weights_only=False" not in str(err.value) and err.value.__cause__ is None


def test_missing_and_truncated_files(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "nope.pt")
    good = checkpoint.save({"w": torch.randn(1000)}, tmp_path / "t.pt")
    data = good.read_bytes()
    good.write_bytes(data[: len(data) // 2])  # what a kill during a plain torch.save leaves
    with pytest.raises(CheckpointError, match="not a loadable checkpoint"):
        checkpoint.load(good)


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    path = checkpoint.save({"step": 1}, tmp_path / "last.pt")

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        checkpoint.save({"step": 2, "bad": Unpicklable()}, path)
    assert checkpoint.load(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


SAVER = textwrap.dedent("""
    import sys, torch
    from d2lpar.processes import checkpoint
    path, big = sys.argv[1], torch.zeros(4_000_000)   # 16 MB: each save takes a while
    step = 0
    while True:
        checkpoint.save({"step": step, "w": big + step}, path)
        print("saved", step, flush=True)
        step += 1
""")


def test_kill_during_save_leaves_the_last_good_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    hit = False
    for attempt in range(5):  # until the kill lands while a temporary file is being written
        job = start([sys.executable, "-c", SAVER, str(path)])
        try:
            assert job.wait_until(lambda: any(line.startswith("saved") for line in job.lines), 60)
            job.lines.clear()
            assert job.wait_until(lambda: bool(list(tmp_path.glob(".last.pt.tmp-*"))), 30)
            os.kill(job.proc.pid, signal.SIGKILL)
            job.wait(10)
        finally:
            job.stop()
        assert job.proc.returncode == -signal.SIGKILL
        hit = bool(list(tmp_path.glob(".last.pt.tmp-*")))
        if hit:
            break
    assert hit, "the kill never landed during a save"
    state = checkpoint.load(path)  # the previous complete checkpoint
    assert torch.equal(state["w"], torch.full((4_000_000,), float(state["step"])))
    checkpoint.save({"step": -1}, path)  # the next save clears the stale temporary file
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
