"""Launcher runs as a notebook shows them: start commands together, wait, keep what they left.

A run is one or more launcher commands started at once (one per "node"), each printed the way a
reader would type it in ``commands.working_folder()`` and run from there, so that what is printed is
what ran (paths as ``commands.typed_path`` writes them: ``build/...`` in the checkout, the real
folder elsewhere). ``Runs.train`` waits for all of them; once one has failed the others get 2 s
(a torchrun agent whose peer node failed would wait minutes at its exit barrier) and are then
stopped. It prints the lines that matter (rank 0's, warnings, errors) and the wall time beside the
same training in the kernel, and keeps each run's log, time and final weights (``last.pt`` in the
folder after ``--out``) under the run's name, for a comparison of every launcher at the end.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import textwrap
import time
from pathlib import Path

from d2lpar.infra.paths import build_dir
from d2lpar.processes import checkpoint
from d2lpar.processes.commands import pretty, sanitize, start, typed_path, working_folder

KEEP = ("rank 0 of", "resumed", "rror", "FutureWarning")  # the lines of a log worth printing


class Runs:
    """The runs of one notebook: their folders under ``workdir``, logs, times and final weights."""

    def __init__(self, workdir: Path):
        self.workdir, self.build = Path(workdir), str(build_dir())
        self.folder = working_folder()  # where the commands are typed and run
        self.final_weights: dict = {}  # how it was launched -> the weights it ended with
        self.logs: dict = {}  # how it was launched -> what its processes printed
        self.seconds: dict = {}  # how it was launched -> wall time of the whole run
        self.reference_s: float | None = None  # the same training in the kernel, for comparison

    def fresh(self, name: str) -> str:
        """An empty folder for one run's checkpoints."""
        folder = self.workdir / name
        shutil.rmtree(folder, ignore_errors=True)
        return str(folder)

    def shown(self, text: str) -> str:
        """Machine paths out (``commands.sanitize``), the build folder as typed in ``self.folder``."""
        marker = "\0build\0"
        text = sanitize(text.replace(self.build, marker))
        return text.replace(marker, typed_path(self.build, self.folder))

    def command(self, cmd: list, env: dict | None = None) -> str:
        """As typed in a shell, folded into lines under 100 characters with backslashes."""
        typed = pretty([str(word) for word in cmd], env=env, cwd=self.folder)
        return " \\\n    ".join(textwrap.wrap(typed, 94, break_long_words=False,
                                               break_on_hyphens=False))

    def in_this_kernel(self, main, args: list) -> tuple[dict, float]:
        """``main(args + --out)`` as one plain process in this kernel (once untimed first, so that
        first-call costs stay out of the time): its final weights and seconds."""
        folder = self.fresh("in_this_kernel")
        with contextlib.redirect_stdout(io.StringIO()):
            main(["--examples", "64", "--epochs", "1", "--out", self.fresh("warm_up")])
        tic = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            main([*args, "--out", folder])
        return checkpoint.load(os.path.join(folder, "last.pt"))["model"], time.perf_counter() - tic

    def train(self, name: str, commands: list, envs: list | None = None, timeout: float = 60,
              again: bool = True) -> None:
        """Run the commands together (say, one per node), wait for all, keep the weights."""
        envs = envs or [None] * len(commands)
        for cmd, extra in zip(commands, envs):
            print("$", self.command(cmd, env=extra))
        jobs = [start(cmd, env=extra, cwd=self.folder) for cmd, extra in zip(commands, envs)]
        print(f"    started {len(jobs)} command(s); waiting for them to end (at most {timeout} s)",
              flush=True)
        codes = wait_all(jobs, timeout)
        log = "\n".join(self.shown("\n".join(job.lines)) for job in jobs)
        aborted = "terminate called without an active exception" in log
        if codes != [0] * len(jobs) and again and aborted:
            # Seen here with two torchrun agents on one machine: a worker aborts (SIGABRT) as its
            # Python exits, after training and destroy_process_group. Say so, and run once more.
            print(f"    exit codes {codes}: a worker aborted at exit (SIGABRT) after training; "
                  f"once more")
            return self.train(name, commands, envs, timeout, again=False)
        if codes != [0] * len(jobs):
            raise RuntimeError(f"exit codes {codes}:\n" + log[-3000:])
        self.report(jobs, name)
        self.logs[name] = log
        folder = commands[0][commands[0].index("--out") + 1]
        self.final_weights[name] = checkpoint.load(os.path.join(folder, "last.pt"))["model"]

    def report(self, jobs: list, name: str) -> None:
        """Print the lines that matter from each job (rank 0's, warnings, errors), and the time."""
        for job in jobs:
            text = self.shown("\n".join(job.lines))
            barrier = "Error waiting on exit barrier" in text  # a torchrun agent's last wait
            for line in text.splitlines():
                if barrier and any(k in line for k in ("frame #", "exit barrier", "DistNetwork")):
                    continue  # its traceback: summed up below in two lines
                if any(k in line for k in KEEP):
                    line = line[line.index("FutureWarning"):] if "FutureWarning" in line else line
                    print("   ", line)
            if barrier:  # torch/distributed/elastic/agent/server/api.py l.1007-1010: logged only
                print("    torchrun logged 'Error waiting on exit barrier' after training: the\n"
                      "    agent hosting the store had already left; logged, not raised (exit 0)")
        self.seconds[name] = max(job.seconds for job in jobs)
        print(f"    ({self.seconds[name]:.1f} s; the same training in this kernel: "
              f"{self.reference_s:.2f} s)")


def wait_all(jobs: list, timeout: float) -> list:
    """Exit codes; once one job has failed the others get 2 s, then are stopped: None for those."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(job.proc.poll() is None for job in jobs):
        if any(job.proc.poll() not in (None, 0) for job in jobs):
            deadline = min(deadline, time.monotonic() + 2)
        time.sleep(0.05)
    try:
        return [job.proc.poll() for job in jobs]
    finally:
        for job in jobs:
            job.stop()
