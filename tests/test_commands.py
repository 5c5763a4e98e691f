"""d2lpar.processes.commands: commands end at their timeout, leave no process behind, print without machine paths."""

import os
import sys
import textwrap
import time

import pytest

from d2lpar.processes.commands import (REPO, CommandFailed, free_port, is_alive, launcher_free_env,
                                       leftovers, pretty, run, start)

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


def test_free_port_is_a_port():
    assert 0 < free_port() < 65536
