"""``make gpu`` (``python -m d2lpar gpu``): everything the course runs on CUDA, in one command.

On a machine with a CUDA GPU it runs, each as its own process with the GPUs visible:

1. the tests that need CUDA (``pytest -m cuda tests``; without a GPU they are skipped);
2. every notebook under nbval (the same cells CI runs on CPUs, now on the GPU branches);
3. ``python -m d2lpar bench overlap`` (a copy on a side stream beside the compute).

It prints one line per part (passed or failed, with its time) and writes the whole output of each
part, with ``python -m d2lpar info`` at the top, to ``build/gpu/report.md``. The exit status is 1 if
any part failed. Without CUDA it says so and exits 0: CPU machines run ``make test``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from d2lpar.infra.paths import build_dir

__all__ = ["PARTS", "main"]

ROOT = Path(__file__).resolve().parents[1]   # the checkout: tests/ and notebooks/ are beside d2lpar/

PARTS = {
    "cuda tests": [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests"],
    "notebooks (nbval)": [sys.executable, "-m", "pytest", "-q", "--nbval-lax", "notebooks"],
    "bench overlap": [sys.executable, "-m", "d2lpar", "bench", "overlap"],
}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:90] if lines else "(no output)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m d2lpar gpu", description=__doc__)
    parser.add_argument("--parts", nargs="*", choices=sorted(PARTS), default=list(PARTS),
                        help="run only these parts")
    args = parser.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("make gpu: no CUDA GPU here (torch.cuda.is_available() is False), so nothing to run; "
              "on CPUs the course's check is `make test`.")
        return 0
    from d2lpar.info import machine_report
    if not (ROOT / "tests").is_dir():
        print(f"make gpu: run it from a checkout of the course (no tests/ beside {ROOT / 'd2lpar'})")
        return 1
    report = [f"# make gpu\n\n```\n{machine_report()}\n```\n"]
    failed = 0
    for name in args.parts:
        start = time.monotonic()
        run = subprocess.run(PARTS[name], cwd=ROOT, capture_output=True, text=True, env=os.environ)
        took = time.monotonic() - start
        status = "passed" if run.returncode == 0 else f"FAILED (exit {run.returncode})"
        failed += run.returncode != 0
        print(f"{name:<20} {status:<18} {took:7.1f} s  {_last_line(run.stdout + run.stderr)}", flush=True)
        report.append(f"## {name}: {status}, {took:.1f} s\n\n`{' '.join(PARTS[name][1:])}`\n\n"
                      f"```\n{run.stdout}{run.stderr}```\n")
    path = build_dir("gpu") / "report.md"
    path.write_text("\n".join(report))
    print(f"report: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 1 if failed else 0
