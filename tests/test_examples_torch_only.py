"""The torch-only scripts of d2lpar/examples import no d2lpar, and the DDP one trains as it claims.

A script counts as torch only when its module docstring says "torch only"; every such file is
covered, whoever adds it. Each is checked twice: by its syntax tree (no ``import d2lpar``, no
relative import), and by loading a copy from an empty folder with every ``d2lpar`` module blocked.
``ddp_torch.py`` then runs on 2 ranks (the copy, with d2lpar blocked in the ranks, started by the
course's launcher with the variables torchrun sets: a torchrun start costs ~5 s here, and notebook
08 starts the script under torchrun, the legacy launcher and SLURM's variables) and once in this
process as a single process, and the saved weights must have moved and agree. Notebook 07 runs the
same comparison; this file runs it on a copy, with d2lpar out of reach, which the notebook cannot.
"""

import ast
import sys

import pytest
import torch

from d2lpar.processes.commands import REPO, leftovers, run
from d2lpar.processes.launch import RankFailed, launch
from tests.torch_only import LAUNCH_VARS, load_copy, run_in_ranks

EXAMPLES = REPO / "d2lpar" / "examples"
PY = sys.executable
SMALL = ["--epochs", "2", "--examples", "512", "--batch-size", "32"]


def torch_only_scripts():
    return [p for p in sorted(EXAMPLES.glob("*.py")) if not p.name.startswith("_")  # scripts only
            and "torch only" in (ast.get_docstring(ast.parse(p.read_text())) or "").lower()]


def d2lpar_imports(source: str) -> list[str]:
    """Every import of d2lpar in ``source``, relative imports included (they reach the package)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "d2lpar"]
        elif isinstance(node, ast.ImportFrom):
            if node.level or (node.module or "").split(".")[0] == "d2lpar":
                found.append("." * node.level + (node.module or ""))
    return found


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    assert leftovers() == [], "a launcher or worker outlived its test"


def test_the_checks_can_fail(tmp_path, monkeypatch):
    assert d2lpar_imports("import os\nimport torch\nfrom torch import nn\n") == []
    assert d2lpar_imports("import d2lpar.infra.data as d\nfrom d2lpar import x\nfrom . import y\n") \
        == ["d2lpar.infra.data", "d2lpar", "."]
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text('"""torch only (not quite)."""\nfrom d2lpar.processes.env import detect\n')
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModuleNotFoundError, match="d2lpar"):
        load_copy(sneaky, tmp_path / "empty", monkeypatch)
    (tmp_path / "empty" / "sneaky.py").write_text(sneaky.read_text() + "def main(argv):\n    pass\n")
    with pytest.raises(RankFailed, match="ModuleNotFoundError.*d2lpar"):   # blocked in the ranks too
        run_in_ranks(tmp_path / "empty" / "sneaky.py", 2, [])


def test_the_ddp_script_is_torch_only():
    assert "ddp_torch.py" in [p.name for p in torch_only_scripts()]
    assert "train_ddp.py" not in [p.name for p in torch_only_scripts()]  # the course's, not to copy


@pytest.mark.parametrize("script", torch_only_scripts(), ids=lambda p: p.name)
def test_torch_only_script_reaches_no_d2lpar(script, tmp_path, monkeypatch):
    assert d2lpar_imports(script.read_text()) == [], f"{script.name} says torch only"
    names = load_copy(script, tmp_path, monkeypatch)
    assert callable(names.get("main")), f"{script.name}: a main() behind `if __name__ == '__main__'`"


def test_ddp_two_ranks_equal_one_process(tmp_path, monkeypatch, no_launcher, capsys):
    script = EXAMPLES / "ddp_torch.py"
    ddp = load_copy(script, tmp_path, monkeypatch)
    run_in_ranks(tmp_path / script.name, 2, ["--out", tmp_path / "two", *SMALL])
    assert "rank 0 of 2 (cpu): epoch 2" in capsys.readouterr().out
    ddp["main"](["--out", str(tmp_path / "one"), *SMALL])
    two = torch.load(tmp_path / "two" / "last.pt", weights_only=True)["model"]
    one = torch.load(tmp_path / "one" / "last.pt", weights_only=True)["model"]
    initial = ddp["make_data_and_model"](512, 0)[1].state_dict()
    # What a rank that took the whole global batch (not B/W) would give: B = 64 in one process.
    ddp["main"](["--out", str(tmp_path / "wrong"), *SMALL[:-1], "64"])
    wrong = torch.load(tmp_path / "wrong" / "last.pt", weights_only=True)["model"]
    gap = max((two[k] - v).abs().max().item() for k, v in one.items())
    print(f"largest |2 ranks - 1 process| = {gap:.1e}")  # 6.0e-08 when written
    for name, value in one.items():
        assert (value - initial[name]).abs().max() > 1e-3, f"{name} did not move"
        assert not torch.allclose(wrong[name], value, rtol=1e-5, atol=1e-6), f"{name}: B=64 == B=32?"
        torch.testing.assert_close(two[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_ddp_resume_continues_the_same_run(tmp_path, monkeypatch, no_launcher, capsys):
    ddp = load_copy(EXAMPLES / "ddp_torch.py", tmp_path, monkeypatch)
    ddp["main"](["--out", str(tmp_path / "straight"), *SMALL])
    ddp["main"](["--out", str(tmp_path / "resumed"), *SMALL[2:], "--epochs", "1"])
    after_one = torch.load(tmp_path / "resumed" / "last.pt", weights_only=True)["model"]
    ddp["main"](["--out", str(tmp_path / "resumed"), *SMALL])
    assert "resumed after epoch 1" in capsys.readouterr().out
    straight = torch.load(tmp_path / "straight" / "last.pt", weights_only=True)["model"]
    resumed = torch.load(tmp_path / "resumed" / "last.pt", weights_only=True)["model"]
    assert not torch.equal(after_one["0.weight"], straight["0.weight"])  # the second epoch ran
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name


def test_bad_input_is_one_sentence(tmp_path, monkeypatch, no_launcher):
    ddp = load_copy(EXAMPLES / "ddp_torch.py", tmp_path, monkeypatch)
    main, Usage = ddp["main"], ddp["Usage"]
    out = ["--out", str(tmp_path / "out")]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(Usage, match="^MASTER_ADDR, MASTER_PORT not set: start with torchrun"):
        main(out)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(Usage, match="--batch-size 32 is the global batch and does not divide over 3"):
        main(out)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    with pytest.raises(Usage, match="^SLURM_LOCALID|^MASTER_ADDR not set"):
        main(out)
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_PORT"):
        monkeypatch.delenv(name)
    (tmp_path / "a_file").write_text("in the way")
    with pytest.raises(Usage, match="cannot write to --out .*a_file/ckpt"):
        main(["--out", str(tmp_path / "a_file" / "ckpt")])
    job = run([PY, str(tmp_path / "ddp_torch.py"), "--out", str(tmp_path / "a_file" / "ckpt")],
              check=False, timeout=60)
    assert job.returncode == 1
    assert job.lines == [f"ddp_torch.py: error: cannot write to --out {tmp_path}/a_file/ckpt "
                         "(Not a directory): give a folder you can write"]


def test_ddp_device_choice_with_faked_gpu_counts(tmp_path, monkeypatch):
    """No GPU needed: the decision is a function of (local rank, processes on the node, GPUs seen)."""
    ddp = load_copy(EXAMPLES / "ddp_torch.py", tmp_path, monkeypatch)
    choose, Usage = ddp["choose_device"], ddp["Usage"]
    cpu, cuda = torch.device("cpu"), lambda i: torch.device("cuda", i)
    assert choose(3, 8, 0)[:2] == (cpu, "gloo")  # no CUDA: gloo on the CPU
    assert "no CUDA GPU" in choose(3, 8, 0)[2]
    assert choose(5, 8, 1)[:2] == (cuda(0), "nccl")  # srun --gpus-per-task=1: its one GPU is cuda:0
    assert choose(0, 8, 1)[:2] == (cuda(0), "nccl")  # torchrun --virtual-local-rank: LOCAL_RANK=0
    assert choose(5, 8, 8)[:2] == (cuda(5), "nccl")  # all 8 visible: cuda:LOCAL_RANK
    assert choose(1, 2, 4)[:2] == (cuda(1), "nccl")  # more than enough
    assert choose(0, 1, 1)[:2] == (cuda(0), "nccl")  # one process, one GPU
    assert choose(5, 8, 8, cpu=True)[:2] == (cpu, "gloo")  # --cpu wins
    with pytest.raises(Usage, match=r"sees 2 GPU\(s\) but 8 processes run on this node: .*--cpu"):
        choose(5, 8, 2)
    for name in ("LOCAL_WORLD_SIZE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    assert ddp["per_node"]() == 1
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "8(x2),3")
    assert ddp["per_node"]() == 8  # no SLURM_NODEID: node 0
    monkeypatch.setenv("SLURM_NODEID", "2")
    assert ddp["per_node"]() == 3  # this node's entry, not the first one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ddp["per_node"]() == 4


def test_ddp_shared_gpu_stops_every_rank_with_one_sentence(tmp_path, monkeypatch):
    """The check after init, without a GPU: the pure rule on faked UUIDs, then the gather itself on
    2 gloo ranks that are told they hold the same GPU (torchrun's 2 workers on a one-GPU node)."""
    ddp = load_copy(EXAMPLES / "ddp_torch.py", tmp_path, monkeypatch)
    shared = ddp["shared_gpus"]
    assert shared(["GPU-a", "GPU-b", "GPU-c"]) is None  # every rank its own GPU
    assert shared(["GPU-a", "GPU-b", "GPU-a"]).startswith(
        "ranks 0 and 2 were given the same GPU (GPU-a): start one process per GPU")
    copy = str(tmp_path / "ddp_torch.py")
    results = launch(_gather_faked_uuids, 2, copy, False)
    assert results == [("Usage", shared(["GPU-0", "GPU-0"]))] * 2  # both ranks, the same sentence
    assert launch(_gather_faked_uuids, 2, copy, True) == [("ok", None)] * 2  # check can pass


def _gather_faked_uuids(copy: str, distinct: bool):
    """In a rank of a gloo group: claim GPU-0 (or GPU-<rank>) and run the script's check."""
    import runpy

    import torch.distributed as dist
    script = runpy.run_path(copy, run_name="torch_only_copy")
    uuid = f"GPU-{dist.get_rank() if distinct else 0}"
    script["torch"].cuda.get_device_properties = lambda device: type("P", (), {"uuid": uuid})
    try:  # (the patch lives in this rank's process only)
        script["check_one_gpu_each"](torch.device("cuda", 0), dist.get_world_size())
    except script["Usage"] as e:
        return "Usage", str(e)
    return "ok", None
