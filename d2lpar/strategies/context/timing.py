"""Does the ring's block transfer hide behind the block's computation? Timed on real ranks.

The device is simulated: each block's attention lasts ``device_wait`` seconds (the real computation,
then a sleep for the rest, as a GPU would compute while its CPU thread waits), so that N ranks on two
cores show the timeline N GPUs would; the messages are real gloo messages. Three runs on the same
ranks, each the median of ``repeats``: the blocks' compute alone, the N-1 transfers alone, and the
ring with each transfer posted before the block's compute.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from d2lpar.strategies.context import ring as R

__all__ = ["ring_overlap"]


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ring_overlap(b: int, heads: int, s_local: int, dh: int, device_wait: float | None = None,
                 repeats: int = 7):
    """In a launched rank: {'compute', 'transfer', 'overlapped', 'device_wait'} seconds and the last
    run's spans. ``device_wait=None`` calibrates it: one block's compute lasts 1.5 times one block's
    transfer measured here (ring attention is sized so that the compute can hide the transfer; on
    TCP the first part of a send is copied while it is posted, so not all of it can hide). In the
    spans, each transfer is drawn from its post for the duration one transfer took alone (measured),
    not until the ``wait()`` that follows the block's compute."""
    n = dist.get_world_size()
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(b, heads, s_local, dh, generator=g) for _ in range(3))
    kv = torch.stack([k, v])

    def compute():
        for _ in range(n):
            t0 = time.perf_counter()
            R.block_attention(q, k, v, "full")
            time.sleep(max(0.0, device_wait - (time.perf_counter() - t0)))

    def transfer():
        x = kv
        for _ in range(n - 1):
            x = R._shift(x, +1, None)
            R.wait()

    spans: list = []
    with torch.no_grad():
        transfer()   # warm-up: the first messages between two ranks set up their buffers
        if device_wait is None:
            one = torch.tensor([_median(transfer, repeats) / max(n - 1, 1)])
            dist.all_reduce(one, op=dist.ReduceOp.MAX)   # every rank the same wait
            device_wait = 1.5 * one.item()
        out = {"device_wait": device_wait, "compute": _median(compute, repeats),
               "transfer": _median(transfer, repeats),
               "overlapped": _median(lambda: R.ring_attention(q, k, v, device_wait=device_wait), repeats)}
        dist.barrier()
        R.ring_attention(q, k, v, device_wait=device_wait, spans=spans)
    one = out["transfer"] / max(n - 1, 1)   # one block's transfer, measured alone
    out["spans"] = [(lane, label.replace("send", "transfer"), start, start + one)
                    if label.startswith("send") else (lane, label, start, end)
                    for lane, label, start, end in spans]
    return out
