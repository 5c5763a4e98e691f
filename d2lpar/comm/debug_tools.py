"""Tools for a run that went wrong, each runnable on launched ranks: a profiler trace of a DDP step,
``py-spy dump`` of a rank while it waits, and torchrun's ``@record`` error file.

* ``profile_ddp_step``: ``torch.profiler`` around two DDP steps on each rank; returns the spans of the
  operators and of the collectives gloo ran (``gloo:all_reduce``), rank by rank, for a timeline.
* ``py_spy_of_a_waiting_rank``: rank 0 waits in an all-reduce while rank 1, before joining it, runs
  ``py-spy dump --pid <rank 0>``: the stack of a process that is stuck, taken from outside it, with
  no change to its code (what one does on a real hang: ``py-spy dump --pid`` on each rank's process).
* ``recorded_failure``: a function under ``torch.distributed.elastic.multiprocessing.errors.record``
  raises on one rank; the decorator writes the error, its traceback and a timestamp to the file
  named by ``TORCHELASTIC_ERROR_FILE`` (torchrun sets one per worker and reports the first failure).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["profile_ddp_step", "py_spy_of_a_waiting_rank", "recorded_failure", "read_error_file"]


def profile_ddp_step(steps: int = 2) -> list[tuple[str, str, float, float]]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)), bucket_cap_mb=0.1)
    x = torch.randn(64, 256)
    model(x).sum().backward()   # warm-up: buckets are built here
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            model(x).sum().backward()
    spans = []
    for e in prof.events():
        name = e.name
        if name.startswith("gloo:") or name in ("aten::addmm", "aten::mm", "DistributedDataParallel.forward"):
            lane = f"rank {rank} comm" if name.startswith("gloo:") else f"rank {rank}"
            start = e.time_range.start / 1e6
            spans.append((lane, name.replace("aten::", ""), start, start + e.time_range.elapsed_us() / 1e6))
    return spans


def py_spy_of_a_waiting_rank(delay: float = 1.0) -> str | None:
    rank = dist.get_rank()
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    out = None
    if rank == 1:
        time.sleep(delay)   # rank 0 is in the all-reduce by now, waiting for this rank
        exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        if os.path.exists(exe):
            for _ in range(5):   # a dump taken while rank 0 is between two lines can miss the wait
                job = subprocess.run([exe, "dump", "--pid", str(pids[0])], capture_output=True,
                                     text=True, timeout=30, env={**os.environ, "NO_COLOR": "1"})
                out = re.sub(r"\x1b\[[0-9;]*m", "", job.stdout or job.stderr)   # no colours
                if "all_reduce" in out:
                    break
                time.sleep(0.5)
        else:
            out = "py-spy is not installed (pip install py-spy)"
    dist.all_reduce(torch.ones(1))
    return out


def recorded_failure(folder: str) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record
    os.environ["TORCHELASTIC_ERROR_FILE"] = os.path.join(folder, f"error_{dist.get_rank()}.json")

    @record
    def train():
        if dist.get_rank() == 1:
            raise ValueError("batch 17 has a label of -1")
    train()


def read_error_file(path: str) -> dict:
    """The message and the time torchrun's error file records."""
    data = json.loads(open(path).read())["message"]
    return {"message": data["message"].splitlines()[0] if isinstance(data, dict) else str(data),
            "timestamp": data.get("extraInfo", {}).get("timestamp") if isinstance(data, dict) else None}
