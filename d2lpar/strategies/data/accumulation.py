"""Gradient accumulation with ``no_sync``, and a check of it that can fail.

To take one optimizer step over m micro-batches, each rank runs the first m - 1 forwards and
backwards inside ``ddp.no_sync()`` (gradients accumulate in ``.grad``, nothing is sent) and the
last one outside (its backward all-reduces the sum). With each loss divided by m, the result equals
one process on the whole batch.

That final equality alone proves nothing about ``no_sync``: averaging is linear, so a ``no_sync``
that still all-reduced every micro-batch would give the same gradients (avg(g1) + avg(g2) =
avg(g1 + g2)), only with m times the messages. So ``accumulate_worker`` counts the all-reduces
actually started (``counting_allreduces`` wraps ``torch.distributed.all_reduce``, whoever calls
it) and keeps each rank's gradients as they stand inside ``no_sync``; ``check_no_sync`` asserts
that inside ``no_sync`` no all-reduce ran and the ranks' gradients *differ*, that the last backward
started one all-reduce per bucket, and that afterwards the ranks agree with one process.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from d2lpar.infra.check import check, check_close, check_equal
from d2lpar.strategies.data.ddp import DDP

__all__ = ["counting_allreduces", "accumulate_worker", "check_no_sync"]


@contextlib.contextmanager
def counting_allreduces():
    """Inside, every call of ``torch.distributed.all_reduce`` (by any module that calls it as
    ``dist.all_reduce``) is counted: yields the list of the sizes (elements) of the tensors sent."""
    real, calls = dist.all_reduce, []

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield calls
    finally:
        dist.all_reduce = real


def accumulate_worker(model: nn.Module, ids: torch.Tensor, y: torch.Tensor, micro: int = 3,
                      cap_mb: float = 25.0) -> dict:
    """One step over ``micro`` micro-batches of this rank's (ids, y), the first ``micro - 1``
    inside ``no_sync``; returns the gradients inside and after, and the all-reduces counted."""
    if micro < 2 or len(y) < micro:
        raise ValueError(f"micro={micro} with {len(y)} samples: accumulation needs at least 2 "
                         "micro-batches and a sample in each")
    ddp = DDP(model, cap_mb)
    parts = list(zip(ids.chunk(micro), y.chunk(micro)))
    with counting_allreduces() as inside:
        with ddp.no_sync():
            for a, b in parts[:-1]:
                (nn.functional.cross_entropy(ddp(a), b) / micro).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with counting_allreduces() as last:
        a, b = parts[-1]
        (nn.functional.cross_entropy(ddp(a), b) / micro).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"inside": local, "allreduces inside": len(inside), "allreduces last": len(last),
            "buckets": len(ddp.buckets), "grads": grads}


def check_no_sync(runs: list[dict], expected: dict, micro: int) -> None:
    """Raise unless ``no_sync`` skipped the all-reduce and the step still equals one process.

    ``runs``: ``accumulate_worker``'s result on every rank; ``expected``: one process's gradients
    on the whole batch.
    """
    check_equal(f"inside no_sync ({micro - 1} backwards): no all-reduce started, on any rank",
                [r["allreduces inside"] for r in runs], [0] * len(runs))
    first = runs[0]["inside"]
    differ = all(any(not torch.equal(first[n], r["inside"][n]) for n in first) for r in runs[1:])
    check("inside no_sync: the ranks' accumulated gradients differ (each kept its own)", differ)
    check_equal("the last backward: one all-reduce started per bucket, on every rank",
                [r["allreduces last"] for r in runs], [r["buckets"] for r in runs])
    for rank, r in enumerate(runs):
        check_close(f"rank {rank}: {micro} micro-batches with no_sync == one batch", r["grads"],
                    expected)
