"""Runs of launcher commands: a failed job stops its partners within seconds, commands fold to
at most 100 characters, a run keeps its weights, time and log, and
torchrun's logged exit-barrier error is summed up in two lines while other errors still print;
outside the checkout a command shows the real build folder and runs where it would be typed."""

import sys
from types import SimpleNamespace
import time

import pytest
import torch

from d2lpar.processes import checkpoint, launcher_runs
from d2lpar.processes.commands import leftovers, start
from d2lpar.processes.launcher_runs import Runs, wait_all

PY = sys.executable


def test_a_failed_job_stops_the_others_within_seconds():
    jobs = [start([PY, "-c", "import time; time.sleep(60)"]), start([PY, "-c", "raise SystemExit(3)"])]
    tic = time.monotonic()
    codes = wait_all(jobs, timeout=60)
    assert codes == [None, 3]  # the sleeper was stopped: no exit code of its own
    assert time.monotonic() - tic < 20
    assert leftovers() == []


def test_a_run_keeps_weights_time_and_log(tmp_path, capsys):
    runs = Runs(tmp_path)
    runs.reference_s = 0.5
    out = runs.fresh("one")
    code = ("import sys, torch; from d2lpar.processes import checkpoint; "
            "print('rank 0 of 1: here'); print('not kept'); "
            "checkpoint.save({'model': {'w': torch.ones(2)}}, sys.argv[-1] + '/last.pt')")
    runs.train("plain", [[PY, "-c", code, "--out", out]])
    printed = capsys.readouterr().out
    after = printed.split("waiting for them")[1]  # what the run printed, after the command
    assert "    rank 0 of 1: here" in after and "not kept" not in after
    assert torch.equal(runs.final_weights["plain"]["w"], torch.ones(2))
    assert runs.seconds["plain"] > 0 and "not kept" in runs.logs["plain"]
    long = [PY, "-m", "torch.distributed.run", *(["--nproc-per-node=2"] * 12), "train.py"]
    assert all(len(line) <= 100 for line in runs.command(long).splitlines())  # at most 100
    assert checkpoint.load(f"{out}/last.pt")["model"]["w"].sum() == 2


def test_an_exit_barrier_error_is_summed_up(tmp_path, capsys):
    runs = Runs(tmp_path)
    runs.reference_s = 0.1
    job = SimpleNamespace(seconds=1.0, lines=[
        "rank 0 of 2: no CUDA GPU visible: gloo on the CPU",
        "E1125 01:48:27 api.py:1008] Error waiting on exit barrier. Elapsed: 0.02 seconds",
        "frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d",
        "E1125 01:48:27 api.py:1008] torch.distributed.DistNetworkError: Failed to recv"])
    runs.report([job], "two nodes")
    out = capsys.readouterr().out
    assert "rank 0 of 2: no CUDA" in out and "logged, not raised (exit 0)" in out
    assert "frame #" not in out and "DistNetworkError" not in out
    runs.report([SimpleNamespace(seconds=1.0, lines=["x: RuntimeError: boom"])], "failed")
    assert "RuntimeError: boom" in capsys.readouterr().out  # other errors are still printed


def test_outside_the_checkout_runs_print_the_real_build_folder_and_run_where_printed(
        tmp_path, monkeypatch, capsys):
    here, build = tmp_path / "student", tmp_path / "cache" / "d2lpar"
    here.mkdir()
    monkeypatch.chdir(here)  # a notebook copied alone into an empty folder, d2lpar installed
    monkeypatch.setenv("D2LPAR_BUILD_DIR", str(build))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    runs = Runs(build / "nb")
    out = runs.fresh("one")
    typed = runs.command([PY, "-m", "torch.distributed.run", "-m", "d2lpar.examples.ddp_torch",
                          "--out", out]).replace(" \\\n    ", " ")
    assert typed == f"torchrun -m d2lpar.examples.ddp_torch --out {build}/nb/one"  # not build/nb
    assert runs.shown(f"resumed from {build}/nb/one/last.pt") == \
        f"resumed from {build}/nb/one/last.pt"
    started = []
    monkeypatch.setattr(launcher_runs, "start", lambda cmd, env, cwd: started.append(cwd) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runs.train("here", [[PY, "-c", "pass", "--out", out]])
    assert started == [here.resolve()]  # run from where the printed command is typed
