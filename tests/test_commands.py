"""d2lpar.processes.commands: commands end at their timeout, leave no process behind, print without machine paths."""

import os
import sys
import textwrap
import time

import pytest

from d2lpar.processes.commands import (REPO, CommandFailed, free_port, is_alive, launcher_free_env,
                                       leftovers, pretty, run, start, typed_path, working_folder)

# A parent that starts a child in a session of its own (as torchrun does with its workers), then waits.
ESCAPER = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    print("child started", flush=True)
    time.sleep(60)
""")


def test_output_and_exit_code():
    job = run([sys.executable, "-c", "print('hello'); import os; print(os.environ['OMP_NUM_THREADS'])"])
    assert job.lines == ["hello", "1"] and job.returncode == 0
    with pytest.raises(CommandFailed, match="exited with 3"):
        run([sys.executable, "-c", "import sys; print('bye'); sys.exit(3)"])


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc (Linux)")
def test_timeout_kills_the_whole_tree_even_children_in_their_own_session():
    job = start([sys.executable, "-c", ESCAPER])
    try:
        assert job.wait_until(lambda: "child started" in job.lines, 30)
        pids = job.pids()
        assert len(pids) == 2  # parent and the escaped child both carry the tag
    finally:
        job.stop()
    time.sleep(0.1)
    assert not any(is_alive(p) for p in pids) and leftovers() == []
    with pytest.raises(CommandFailed, match="ran past 0.5 s"):
        run([sys.executable, "-c", ESCAPER], timeout=0.5)


def test_launcher_variables_are_not_inherited(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("SLURM_PROCID", "3")
    env = launcher_free_env({"X": "1"})
    assert "RANK" not in env and "SLURM_PROCID" not in env and env["X"] == "1"


def test_pretty_prints_what_a_reader_types():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           str(REPO / "d2lpar/examples/train_ddp.py")]
    assert pretty(cmd) == "torchrun --standalone d2lpar/examples/train_ddp.py"
    assert pretty([sys.executable, "x.py"], env={"SLURM_PROCID": "0"}) == "SLURM_PROCID=0 python x.py"


def test_commands_are_typed_in_the_checkouts_root_inside_it_else_where_you_are(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO / "notebooks")  # a notebook's kernel in the checkout
    assert working_folder() == REPO
    assert pretty([sys.executable, str(REPO / "build" / "x")]) == "python build/x"
    monkeypatch.chdir(tmp_path)  # a notebook copied alone into an empty folder
    assert working_folder() == tmp_path.resolve()
    cmd = [sys.executable, "-m", "torch.distributed.run", "-m", "d2lpar.examples.ddp_torch",
           "--out", str(tmp_path / "runs" / "a")]
    assert pretty(cmd) == "torchrun -m d2lpar.examples.ddp_torch --out runs/a"


def test_a_path_outside_the_folder_is_printed_as_it_really_is(tmp_path, monkeypatch):
    here, home, cache = tmp_path / "student", tmp_path / "home", tmp_path / "cache" / "d2lpar"
    for folder in (here, home):
        folder.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    assert typed_path(here / "build" / "x") == "build/x"
    assert typed_path(home / ".cache" / "d2lpar" / "07_ddp") == "~/.cache/d2lpar/07_ddp"
    assert typed_path(cache / "07_ddp") == str(cache / "07_ddp")  # never build/07_ddp here
    assert typed_path(cache / "07_ddp", folder=tmp_path) == "cache/d2lpar/07_ddp"
    # quoted for the shell, with ~ left where the shell expands it (not inside quotes, not after =)
    assert pretty(["ls", str(home / "a b"), f"--out={home / 'c'}"]) == \
        f"ls ~/'a b' --out={home / 'c'}"
    assert typed_path("~x", folder=here) == "~x"  # a relative name is relative to the folder


def test_free_port_is_a_port():
    assert 0 < free_port() < 65536
