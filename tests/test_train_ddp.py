"""d2lpar/examples/train_ddp.py (the course's DDP script, on top of d2lpar): bad input is a clear error.

Notebook 07 (run by nbval in `make test`) trains with its `main` on two ranks and in one process and
checks that they agree; notebook 08 starts the torch-only `ddp_torch.py` under every launcher
(tests/test_examples_torch_only.py covers that script). This file does not run them again.
"""

import sys

import pytest
import torch

from d2lpar.processes import checkpoint
from d2lpar.processes.commands import REPO, leftovers, run
from d2lpar.processes.env import EnvError
from d2lpar.examples import train_ddp

SCRIPT = str(REPO / "d2lpar" / "examples" / "train_ddp.py")
ARGS = ["--train-size", "512", "--epochs", "3", "--batch-size", "32", "--timeout", "60"]
PY = sys.executable
TIMEOUT = 90


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    assert leftovers() == [], "a launcher or worker outlived its test"


def test_bad_input_is_a_clear_error(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(EnvError, match="planned for world size 4, but single started 1"):
        train_ddp.main([*ARGS, "--world-size", "4"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(EnvError, match="MASTER_ADDR is not set"):
        train_ddp.main(ARGS)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(EnvError, match="must divide evenly over 3 processes"):
        train_ddp.main(ARGS)
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(name)
    checkpoint.save(checkpoint.training_state(torch.nn.Linear(2, 2)), tmp_path / "last.pt")
    with pytest.raises(checkpoint.CheckpointError, match="from another model"):
        train_ddp.main([*ARGS, "--ckpt-dir", str(tmp_path)])


@pytest.mark.parametrize("argv,said", [
    (["--epochs", "0"], "--epochs 0: train at least 1 epoch"),
    (["--epochs", "-2"], "--epochs -2: train at least 1 epoch"),
    (["--train-size", "0"], "--train-size 0: give a positive number of images"),
    (["--batch-size", "0"], "--batch-size 0: the global batch needs at least 1 example"),
    (["--timeout", "0"], "--timeout 0.0: give the seconds a rank may wait"),
    (["--timeout", "inf"], "--timeout inf: give the seconds"),
    (["--lr", "nan"], "--lr nan: give a finite learning rate"),
])
def test_options_that_cannot_work_are_refused_at_start(argv, said, capsys):
    with pytest.raises(SystemExit) as out:
        train_ddp.parse_args(argv)
    assert out.value.code == 2
    assert f"train_ddp.py: error: {said}" in capsys.readouterr().err


def test_an_unwritable_checkpoint_folder_is_found_before_the_first_epoch(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit):
        train_ddp.parse_args(["--ckpt-dir", str(blocker / "ckpt")])
    assert f"--ckpt-dir {blocker / 'ckpt'} cannot be written" in capsys.readouterr().err
    assert train_ddp.parse_args(["--ckpt-dir", str(tmp_path / "new" / "ckpt")]).ckpt_dir   # made


def test_command_line_error_is_one_line():
    job = run([PY, SCRIPT, "--world-size", "2"], timeout=TIMEOUT, check=False)
    assert job.returncode == 1
    assert job.lines[-1].startswith("train_ddp.py: error: this job was planned for world size 2")


def test_the_device_follows_the_gpus_each_process_sees(monkeypatch):
    """No GPU needed: one visible GPU is this process's (srun --gpus-per-task=1, torchrun
    --virtual-local-rank); several give cuda:LOCAL_RANK; too few is one sentence, never the CPU."""
    from d2lpar.processes.env import DistEnv
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    who = DistEnv(rank=5, world_size=16, local_rank=5, local_world_size=8)
    for visible, expected in [(1, torch.device("cuda", 0)), (8, torch.device("cuda", 5))]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda v=visible: v)
        assert train_ddp.choose_device(who) == (expected, "nccl")
    assert train_ddp.choose_device(who, cpu=True) == (torch.device("cpu"), "gloo")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(EnvError, match="sees 2 GPUs but 8 processes run on this node: .*--cpu"):
        train_ddp.choose_device(who)
