"""Tools for a run that went wrong, each runnable on launched ranks: a profiler trace of a DDP step,
``py-spy dump`` of a rank while it waits, and torchrun's ``@record`` error file.

* ``profile_ddp_step``: ``torch.profiler`` around two DDP steps on each rank, one bucket per layer
  and each layer's backward compute a 20 ms sleep (a stand-in for a GPU's kernels, which survives
  a busy machine better than real CPU work); returns the spans of the backward compute, the products
  and the collectives gloo ran (``gloo:all_reduce``), and the order in which backward's layers and
  the buckets' all-reduce launches happened.
* ``detail_mismatch``: the lines of a ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` error that matter.
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

__all__ = ["profile_ddp_step", "detail_mismatch", "py_spy_of_a_waiting_rank", "recorded_failure", "read_error_file"]


class _ComputeStandIn(torch.autograd.Function):
    """Identity forward; in backward, a sleep standing in for a layer's device compute."""

    @staticmethod
    def forward(ctx, x, seconds, layer, log):
        ctx.seconds, ctx.layer, ctx.log = seconds, layer, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(f"backward compute of layer {ctx.layer}")
        with torch.profiler.record_function("backward compute"):
            time.sleep(ctx.seconds)
        return grad, None, None, None


class _Layers(nn.Module):
    """``layers`` Linear layers; before each, the stand-in, whose backward runs after that layer's
    gradients are ready: the compute of the layers below it."""

    def __init__(self, width: int, layers: int, seconds: float, log: list):
        super().__init__()
        self.layers, self.seconds, self.log = nn.ModuleList(
            nn.Linear(width, width) for _ in range(layers)), seconds, log

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(_ComputeStandIn.apply(x, self.seconds, i, self.log)))
        return x


def profile_ddp_step(steps: int = 2, compute_s: float = 0.02, layers: int = 4,
                     width: int = 1024) -> dict:
    """Two DDP steps under ``torch.profiler``, one bucket per layer (``bucket_cap_mb`` below one
    layer's weight), each layer's backward compute a sleep of ``compute_s``.

    Returns ``spans`` (lane, name, start, end) of the backward compute, the products and gloo's
    collectives, and ``order``: this rank's events of the last step in the order they happened,
    "backward compute of layer i" (the stand-in) and "all-reduce of bucket b launched" (DDP's
    communication hook, called when the bucket's gradients are all ready).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile
    rank, log = dist.get_rank(), []
    torch.manual_seed(0)
    layer_mb = width * width * 4 / 2**20
    model = DDP(_Layers(width, layers, compute_s, log), bucket_cap_mb=layer_mb * 0.8)

    def launched(state, bucket):
        log.append(f"all-reduce of bucket {bucket.index()} launched")
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, launched)
    x = torch.randn(64, width)
    model(x).sum().backward()   # warm-up: DDP rebuilds its buckets after the first step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            log.clear()
            model(x).sum().backward()
    spans = []
    for e in prof.events():
        name = e.name
        if name.startswith("gloo:") or name in ("aten::addmm", "aten::mm", "backward compute"):
            lane = f"rank {rank} comm" if name.startswith("gloo:") else f"rank {rank}"
            start = e.time_range.start / 1e6
            end = start + e.time_range.elapsed_us() / 1e6
            spans.append((lane, name.replace("aten::", ""), start, end))
    return {"spans": spans, "order": list(log)}


def detail_mismatch(message: str) -> list[str]:
    """What matters in a ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` mismatch error, one short line each: every
    rank's fingerprint (operation, shape, dtypes; not the TensorOptions(...) boilerplate) and the
    aspects it says differ."""
    prints = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                        r"OpType=(\w+), TensorShape=(\[[^\]]*\]), TensorDtypes=(\w+)", message)
    lines = [f"rank {r}: collective #{int(seq) + 1}, {op}, shape {shape}, dtype {dtype}"
             for r, seq, op, shape, dtype in prints]
    differ = re.search(r"Collectives differ in the following aspects:\s*(.*)$", message)
    if differ:
        said = re.sub(r"(\S)vs ", r"\1 vs ", differ.group(1).replace("Tensor Tensor", "tensor"))
        lines.append("they differ in: " + " ".join(said.split()))
    return lines


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
