"""Tensor (channel) parallelism: one layer's weights split over t ranks, and the collectives it needs.

A linear layer ``Y = X W^T`` with W of shape (out, in) can be cut two ways.

* **Column-parallel** (cut the outputs): rank r holds rows r of W, ``W_r`` of shape (out/t, in), and
  computes ``Y_r = X W_r^T``, its own out/t output features, from the whole input X. This is the
  source notes' "channel parallelism" (AlexNet's two GPUs each computed half of a layer's channels).
* **Row-parallel** (cut the inputs): rank r holds columns r of W, shape (out, in/t), and computes a
  partial sum ``Y^(r) = X_r W_r^T`` from its slice X_r of the input; ``Y = sum_r Y^(r)``.

Megatron-LM pairs them: a column-parallel layer leaves its output split, which is exactly what the
row-parallel layer that follows wants, so ``Linear -> GELU -> Linear`` needs no communication inside and
one all-reduce at the end. Two tiny autograd functions place that communication (Shoeybi et al., 2019):

    f: forward identity,   backward all-reduce   (enter the parallel region: X is replicated, so the
                                                  partial input gradients of the ranks must be summed)
    g: forward all-reduce, backward identity     (leave it: sum the partial outputs)

Sequence parallelism (Korthikanti et al., 2022) notices that an all-reduce is a reduce-scatter followed
by an all-gather, and moves the halves apart: g becomes a *reduce-scatter* along the sequence, so the
LayerNorm, dropout and residual between two parallel regions run on s/t tokens per rank, and f becomes
an *all-gather* along the sequence. The same bytes travel; the activations outside the parallel
regions shrink t times. Per rank, for a tensor of K bytes (ring algorithms):

    all-reduce 2(t-1)K/t,   all-gather (t-1)K/t,   reduce-scatter (t-1)K/t.

The layers built from these functions are in ``d2lpar.strategies.tensor.layers`` (column, row,
and the source notes' channel split of a convolution) and ``d2lpar.strategies.tensor.blocks`` (MLP, attention, transformer layer).

Every collective here is recorded by ``count_comms()`` (kind, pass, tensor bytes, group size), so tests
and notebooks compare counts and bytes with formulas. Layers take ``group=`` (default: the world), so a
(dp, tp) mesh can give each tensor-parallel group its own process group. Parameters carry
``tp_dim`` (the dimension they are split along, None when replicated) and ``sequence_parallel`` (True
when their gradient is partial per rank and needs ``sync_sequence_parallel_grads``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from d2lpar.comm.collectives import ring_rank_bytes

__all__ = ["Comm", "CommLog", "count_comms", "record_comm", "torch_counts", "tp_world", "require_divisible", "check_same_shape",
           "check_same_input",
           "copy_to_region", "reduce_from_region", "gather_from_region", "scatter_to_region",
           "all_gather_seq", "reduce_scatter_seq", "shard"]

# ---------------------------------------------------------------------------------- counting

@dataclass(frozen=True)
class Comm:
    kind: str      # all_reduce, all_gather, reduce_scatter
    phase: str     # forward or backward
    nbytes: int    # bytes of the whole tensor (all-gather: its output; reduce-scatter: its input)
    ranks: int     # size of the group
    start: float = field(default=0.0, compare=False)   # perf_counter() when it began and ended
    end: float = field(default=0.0, compare=False)

    @property
    def sent(self) -> float:
        """Bytes this rank sends (and receives) with a ring algorithm."""
        return ring_rank_bytes(self.kind, self.nbytes, self.ranks)


@dataclass
class CommLog:
    """The collectives one rank ran inside ``count_comms()``."""
    comms: list[Comm] = field(default_factory=list)

    def counts(self, phase: str | None = None) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.comms:
            if phase in (None, c.phase):
                out[c.kind] = out.get(c.kind, 0) + 1
        return dict(sorted(out.items()))

    def sent(self, phase: str | None = None) -> float:
        return sum(c.sent for c in self.comms if phase in (None, c.phase))

    def summary(self) -> dict:
        return {p: {"counts": self.counts(p), "sent": self.sent(p)} for p in ("forward", "backward")}

    def handed(self) -> list[tuple[str, str, int]]:
        """(kind, phase, bytes of the tensor handed to it) of every collective, sorted: real sizes."""
        return sorted((c.kind, c.phase, c.nbytes) for c in self.comms)


_logs: list[CommLog] = []


@contextlib.contextmanager
def count_comms():
    """Record every tensor-parallel collective this rank runs inside the block."""
    log = CommLog()
    _logs.append(log)
    try:
        yield log
    finally:
        _logs.remove(log)


def record_comm(kind: str, phase: str, nbytes: int, ranks: int, start: float = 0.0,
                end: float = 0.0) -> None:
    for log in _logs:
        log.comms.append(Comm(kind, phase, int(nbytes), ranks, start, end))


_TORCH_NAMES = {"all_reduce": "all_reduce", "allreduce_": "all_reduce",
                "all_gather_into_tensor": "all_gather", "allgather_": "all_gather",
                "allgather_into_tensor_coalesced": "all_gather", "_allgather_base_": "all_gather",
                "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
                "_reduce_scatter_base_": "reduce_scatter"}


def torch_counts(mode) -> dict[str, int]:
    """A ``CommDebugMode``'s counts under our names (it sees DTensor's functional collectives and
    plain ``dist`` calls alike: ``c10d_functional.all_reduce`` and ``c10d.allreduce_`` are both
    ``all_reduce``)."""
    out: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1].split("'")[0]
        kind = _TORCH_NAMES.get(name, name)
        out[kind] = out.get(kind, 0) + n
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- groups and errors

def tp_world(group=None) -> tuple[int, int]:
    """(rank, size) of this process in ``group`` (None: the world); a clear error outside one."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensor-parallel layers need a process group, and there is none here: "
                           "run them on ranks (d2lpar.processes.launch.launch(fn, t) or torchrun, "
                           "after dist.init_process_group), or use the plain single-device module")
    return dist.get_rank(group), dist.get_world_size(group)


def require_divisible(what: str, value: int, ranks: int) -> None:
    if value % ranks:
        divisors = [d for d in range(1, value + 1) if value % d == 0]
        near = sorted({value - value % ranks, value - value % ranks + ranks} - {0})
        raise ValueError(f"{what} = {value} is not divisible by the {ranks} tensor-parallel ranks: "
                         f"make {what} a multiple of {ranks} (such as {' or '.join(map(str, near))}), "
                         f"or a number of ranks that divides {value} ({', '.join(map(str, divisors))})")


def check_same_shape(layer: str, shape: tuple[int, ...], group=None,
                     names: tuple[str, ...] | None = None) -> None:
    """Raise on every rank if the ranks built ``layer`` with different shapes (before any hang).

    ``shape``: up to 8 sizes (non-negative ints); ``names``: what each is, to name them in the error.
    """
    rank, size = tp_world(group)
    mine = torch.full((8,), -1, dtype=torch.int64)
    mine[:len(shape)] = torch.tensor(shape, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    shapes = [tuple(int(v) for v in t if v >= 0) for t in every]
    if len(set(shapes)) > 1:
        if names:
            said = "; ".join(f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in zip(names, s))
                             for r, s in enumerate(shapes))
        else:
            said = ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
        raise ValueError(f"the ranks disagree on the shape of {layer} ({said}): every rank of a "
                         "tensor-parallel group must build the same full layer and keep its own part")


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)


def check_same_input(layer: str, x: torch.Tensor, group=None) -> None:
    """Raise on every rank if the ranks give ``layer`` inputs of different shapes or dtypes.

    Each rank's collectives would then move messages of different sizes: gloo aborts the process
    (or, with equal byte counts, sums the wrong numbers). One small all-gather, on a layer's first
    forward only (the shapes of later batches are the same program's).
    """
    rank, size = tp_world(group)
    if x.dim() > 6:
        return
    mine = torch.full((8,), -1, dtype=torch.int64)
    code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
    mine[:x.dim() + 2] = torch.tensor([code, x.dim(), *x.shape], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(size)]
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():   # a check, not the layer's communication: CommDebugMode must not count it
        dist.all_gather(every, mine, group=group)
    seen = [tuple(int(v) for v in t if v >= 0) for t in every]
    if len(set(seen)) > 1:
        def said(s):
            dtype = _DTYPES[s[0]] if s[0] < len(_DTYPES) else "another dtype"
            return f"shape {tuple(s[2:])} ({str(dtype).removeprefix('torch.')})"
        raise ValueError(f"the ranks give {layer} different inputs ("
                         + "; ".join(f"rank {r}: {said(s)}" for r, s in enumerate(seen))
                         + "): every rank of a tensor-parallel group must get the same batch, in the "
                         "same dtype (the same data and seed on each, not a different data shard)")


def shard(full: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim`` (equal slices)."""
    rank, size = tp_world(group)
    require_divisible(f"size of dimension {dim}", full.shape[dim], size)
    return full.chunk(size, dim)[rank].clone()


# ------------------------------------------------------------------------ the four collectives

def _all_reduce(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    _, size = tp_world(group)
    if size == 1:
        return x
    x = x.contiguous().clone()
    t0 = time.perf_counter()
    dist.all_reduce(x, group=group)
    record_comm("all_reduce", phase, x.numel() * x.element_size(), size, t0, time.perf_counter())
    return x


def _all_gather(x: torch.Tensor, dim: int, group, phase: str) -> torch.Tensor:
    _, size = tp_world(group)
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    record_comm("all_gather", phase, size * x.numel() * x.element_size(), size)
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group, phase: str) -> torch.Tensor:
    _, size = tp_world(group)
    if size == 1:
        return x
    require_divisible(f"size of dimension {dim} (to reduce-scatter)", x.shape[dim], size)
    parts = [p.contiguous() for p in x.chunk(size, dim)]
    out = torch.empty_like(parts[0])
    record_comm("reduce_scatter", phase, x.numel() * x.element_size(), size)
    dist.reduce_scatter(out, parts, group=group)
    return out


def _slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    rank, size = tp_world(group)
    require_divisible(f"size of dimension {dim}", x.shape[dim], size)
    return x.chunk(size, dim)[rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, "backward"), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllGather(torch.autograd.Function):
    """Sequence parallelism's f: all-gather forward, reduce-scatter backward."""
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group, "backward"), None, None


class _ReduceScatter(torch.autograd.Function):
    """Sequence parallelism's g: reduce-scatter forward, all-gather backward."""
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, "backward"), None, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather forward (collect the split outputs), slice backward (each rank keeps its part)."""
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.dim, ctx.group), None, None


class _ScatterToRegion(torch.autograd.Function):
    """Slice forward (keep this rank's part of a replicated tensor), all-gather backward."""
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, "backward"), None, None


def copy_to_region(x, group=None):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x, group=None):
    """Megatron's g: all-reduce forward, identity backward."""
    return _ReduceFromRegion.apply(x, group)


def all_gather_seq(x, dim=1, group=None):
    """Sequence-parallel f: all-gather along the sequence forward, reduce-scatter backward."""
    return _AllGather.apply(x, dim, group)


def reduce_scatter_seq(x, dim=1, group=None):
    """Sequence-parallel g: reduce-scatter along the sequence forward, all-gather backward."""
    return _ReduceScatter.apply(x, dim, group)


def gather_from_region(x, dim=-1, group=None):
    """All-gather the ranks' parts along ``dim``; backward keeps this rank's part of the gradient."""
    return _GatherFromRegion.apply(x, dim % x.dim(), group)


def scatter_to_region(x, dim=-1, group=None):
    """This rank's part of a replicated tensor; backward all-gathers the gradient."""
    return _ScatterToRegion.apply(x, dim % x.dim(), group)
