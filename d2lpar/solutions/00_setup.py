"""Worked solutions to the exercises of notebook 00 (setup, devices, a first launch).

Each ``exercise_k`` computes its answer, prints it, and asserts what the answer claims.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from d2lpar.infra.timing import Benchmark, Timeline
from d2lpar.processes.launch import launch


def all_reduce_worker(size, op_name="SUM"):
    t = torch.full((size,), float(dist.get_rank()))
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op_name))
    return t


def exercise_1():
    """A warm launch of 8 ranks: each rank holds 0 + 1 + ... + 7 = 28 afterwards."""
    launch(all_reduce_worker, 8, 3, quiet=True)  # warm: the forkserver is up
    with Benchmark("a warm launch of 8 ranks with one all-reduce") as bench:
        results = launch(all_reduce_worker, 8, 3, quiet=True)
    assert [r.tolist() for r in results] == [[28.0] * 3] * 8, results
    print("every one of the 8 ranks holds [28, 28, 28]; compare the time with the 4-rank launch: "
          "more ranks than cores, so it grows")
    return bench


def exercise_2():
    """ReduceOp.MAX: every rank holds the largest rank, 3, not the sum 6."""
    results = launch(all_reduce_worker, 4, 3, "MAX", quiet=True)
    expected = torch.stack([torch.full((3,), float(r)) for r in range(4)]).max(0).values
    assert all(torch.equal(r, expected) for r in results) and expected.tolist() == [3.0] * 3
    print(f"with MAX every rank holds {expected.tolist()}: check_close(..., [expected] * 4) "
          f"with expected = the element-wise max over ranks")


def _timed_worker(equal, unit_s):
    # A calibrated wait stands in for compute, so that what is measured is *when*, not how busy
    # the cores are (other programs share them): rank r works unit_s, or (r + 1) unit_s.
    rank, tl = dist.get_rank(), Timeline()
    with tl.span(f"rank {rank}", "compute"):
        time.sleep(unit_s * (1 if equal else rank + 1))
    with tl.span(f"rank {rank}", "all_reduce (incl. waiting)"):
        dist.all_reduce(torch.ones(4))
    return tl.spans


def _waits(equal, unit_s=0.05):
    spans = [s for rank in launch(_timed_worker, 4, equal, unit_s, quiet=True) for s in rank]
    last = max(s.end for s in spans if s.label == "compute")
    ends = [s.end for s in spans if s.label.startswith("all_reduce")]
    assert all(e >= last for e in ends), "an all-reduce finished before the slowest rank computed"
    return {s.lane: s.duration for s in spans if s.label.startswith("all_reduce")}


def exercise_3():
    """Equal work: every rank waits only for messages (and jitter), not for a slower peer."""
    unequal, equal = _waits(False), _waits(True)
    for name, w in (("unequal work (rank r: r + 1 units)", unequal), ("equal work", equal)):
        print(f"{name:<36} waits (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(w.items())))
    # With unequal work rank 0 waits three units (150 ms) for rank 3; with equal work nobody does.
    assert max(equal.values()) < max(unequal.values()) / 2, (equal, unequal)


def exercise_4():
    """CUDA_VISIBLE_DEVICES naming GPUs that do not exist: the report says so, in words."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,7")
    out = subprocess.run([sys.executable, "-m", "d2lpar", "info"], env=env, capture_output=True,
                         text=True, timeout=120).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("GPUs"))
    print(line)
    if torch.cuda.device_count() < 8:  # fewer GPUs than the 8 that index 7 needs
        assert "names 2 device(s)" in line and "nvidia-smi -L" in line, out
    print("CUDA alone would silently hide the missing GPU (or show none) and fail later with an "
          "'invalid device ordinal'; the report names the variable, the count and the fix")
