"""DistributedDataParallel from the inside: buckets of gradients all-reduced while backward runs.

Data parallelism needs, after every backward, the average over the W ranks of every gradient,
``g = (g_0 + ... + g_{W-1}) / W``. Three ways to get it, each slower to write and faster to run:

1. all-reduce each gradient after backward: one collective per parameter, each paying the
   latency alpha, and none starting before the whole backward is done;
2. one all-reduce of all gradients flattened into one buffer: one alpha, still after backward;
3. **buckets that overlap backward** (what ``torch.nn.parallel.DistributedDataParallel`` does).
   Backward produces gradients last layer first, so the parameters are put into buckets in
   *reverse* registration order, each filled until it reaches ``cap`` bytes (a bucket closes once it
   is at least the cap, so a weight stays with its bias). A hook on every parameter fires when its
   gradient has been accumulated; when the last gradient of a bucket arrives the bucket is copied
   into one flat buffer and its all-reduce starts *asynchronously*, while backward goes on with the
   layers below. At the end of backward we wait for the buckets and copy the averages back.

With B buckets of K_b bytes and a ring all-reduce over W ranks (latency alpha, bandwidth beta), the
communication costs ``sum_b 2(W-1)(alpha + K_b / (W beta))``: small buckets start early but pay
alpha often, large buckets pay alpha rarely but start late (``d2lpar.cost.buckets`` finds the best
cap). The all-reduces must be started in the same order on every rank, so bucket b is launched only
once buckets 0..b-1 have been.

Also here, as in torch: parameters and buffers are broadcast from rank 0 when wrapping (after a
check that every rank has the same names and shapes); buffers are broadcast again at each forward
that follows a synchronizing one (``broadcast_buffers``); ``no_sync()`` skips the all-reduce so that
gradients accumulate locally (decided by the *forward*: a forward outside ``no_sync`` synchronizes
even if its backward runs inside); a parameter that gets no gradient is an error naming it, unless
``find_unused_parameters=True`` (then it counts as zero); ``compress='fp16'|'bf16'`` sends the
buckets in half precision (half the bytes, about 3 or 2 significant digits). Parameters that do not
require a gradient (frozen) are never sent; a parameter shared by two layers (tied weights) is one
parameter and is sent once. What is left out: ``Join``, ``static_graph``, rebuilding buckets from
the observed order, sparse gradients, gradients as views of the buckets.

When backward returns, nothing of this DDP is left with gloo (``pending()`` is empty): every
all-reduce has been waited for and dropped, and no gloo thread holds a buffer any more; every
buffer is this DDP's own, allocated once (compressed ones too). Otherwise a gloo thread could be
the one to free a buffer, as the interpreter shuts down, and abort the process
(``d2lpar.comm.drain`` says how; ``python -m d2lpar bench ddp --exit-aborts 100`` counts such
aborts). ``close()`` does the same for a step cut short by an error.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from d2lpar.comm.drain import drain, held_elsewhere, let_go
from d2lpar.infra.timing import Timeline

__all__ = ["assign_buckets", "DDP", "allreduce_each", "allreduce_flat", "TiedToy"]

_MB = 2 ** 20
_DTYPES = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}


def assign_buckets(nbytes: Sequence[int], cap: int,
                   first_cap: int | None = None) -> list[list[int]]:
    """Cut a list of gradient sizes (in the order they become ready) into buckets, as torch does.

    Returns lists of positions into ``nbytes``. A bucket closes as soon as it holds at least its cap
    (``first_cap`` for the first bucket, default ``cap``).
    """
    if cap <= 0 or (first_cap is not None and first_cap <= 0):
        raise ValueError(f"bucket cap must be positive, got {cap} bytes (first {first_cap}): pass "
                         "bucket_cap_mb > 0, e.g. 25 (torch's default)")
    buckets, current, size, limit = [], [], 0, first_cap or cap
    for i, b in enumerate(nbytes):
        current.append(i)
        size += b
        if size >= limit:
            buckets.append(current)
            current, size, limit = [], 0, cap
    return buckets + ([current] if current else [])


@torch.no_grad()
def allreduce_each(params) -> int:
    """Way 1: after backward, average each gradient with its own all-reduce. Returns the count."""
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        dist.all_reduce(g)
        g.div_(dist.get_world_size())
    return len(grads)


@torch.no_grad()
def allreduce_flat(params) -> int:
    """Way 2: after backward, one all-reduce of every gradient flattened. Returns the bytes sent."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads]).div_(dist.get_world_size())
    dist.all_reduce(flat)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))
    return flat.numel() * flat.element_size()


def _cap_bytes(bucket_cap_mb) -> int:
    """torch's rule: ``int(mb * 2**20)`` bytes, and None means its default of 25 MiB."""
    if bucket_cap_mb is None:
        bucket_cap_mb = 25.0
    if (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
            or not math.isfinite(bucket_cap_mb)):
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}: give a finite number of MiB above 0, "
                         "e.g. 25 (torch's default, also what None means) or 0.001")
    cap = int(bucket_cap_mb * _MB)
    if cap <= 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} gives a cap of {cap} bytes: a bucket "
                         "must hold at least one byte; use e.g. 25 (torch's default) or 0.001")
    return cap


class DDP(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves the rank-averaged gradient in every ``.grad``.

    bucket_cap_mb: bucket size in MiB (torch's meaning: ``int(mb * 2**20)`` bytes; None: 25).
    timeline: if given, each bucket's all-reduce is recorded as a span on lane ``rank r comm``.
    process_group: the ranks that share this model (default: all).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, *,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 compress: str | None = None, timeline: Timeline | None = None,
                 process_group=None):
        super().__init__()
        cap = _cap_bytes(bucket_cap_mb)
        if compress not in _DTYPES:
            raise ValueError(f"compress={compress!r}: use None, 'fp16' or 'bf16'")
        if not dist.is_initialized():
            raise RuntimeError("DDP needs a process group: run it under d2lpar.processes.launch "
                               "or torchrun, after dist.init_process_group()")
        self.module, self.find_unused = module, find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.compress, self.timeline = _DTYPES[compress], timeline
        self.group = process_group  # None: every rank
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self._check_same_model()
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=self._src, group=self.group)
        # Buckets: trainable parameters, last registered first (the order backward produces them).
        self.params = [p for p in module.parameters() if p.requires_grad][::-1]
        names = {id(p): n for n, p in module.named_parameters()}
        self.names = [names[id(p)] for p in self.params]
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ValueError("this DDP keeps every gradient in one dtype on one device: convert "
                             "the model with .to(dtype, device) before wrapping it")
        sizes = [p.numel() * p.element_size() for p in self.params]
        self.buckets = [[self.params[i] for i in b] for b in assign_buckets(sizes, cap)]
        self.bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        # One flat buffer per bucket, allocated once (a fresh one per step would cost page faults).
        self.flats = [torch.empty(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                      for b in self.buckets]
        # compressed buckets, allocated once too: gloo is only ever handed this DDP's own buffers
        self.sends = [torch.empty_like(f, dtype=self.compress) for f in self.flats] \
            if self.compress is not None else []
        self._used = torch.zeros(len(self.params))   # find_unused_parameters' flags, the same
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self._sync, self._sync_buffers_next, self._step_syncs, self._backwards = True, True, True, 0
        self._reset()

    def _check_same_model(self) -> None:
        mine = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in
                list(self.module.named_parameters()) + list(self.module.named_buffers())]
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)  # every rank sees every list, so every rank raises
        for rank, theirs in enumerate(everyone):
            if theirs == everyone[0]:
                continue
            for (n0, s0, d0), (n, s, d) in zip(everyone[0], theirs):
                if (n0, s0, d0) != (n, s, d):
                    raise ValueError(f"rank 0 and rank {rank} hold different models: rank 0 has "
                                     f"{n0!r} of shape {s0} ({d0}), rank {rank} has {n!r} of shape "
                                     f"{s} ({d}). Build the same model, in the same dtype, on every "
                                     "rank before wrapping it")
            raise ValueError(f"rank 0 has {len(everyone[0])} parameters and buffers, rank {rank} "
                             f"has {len(theirs)}: build the same model on every rank")

    def _reset(self) -> None:
        self._arrived = [0] * len(self.buckets)
        self._ready: set[int] = set()
        self._next, self._works, self._queued = 0, [], False

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self._sync_buffers_next:
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, src=self._src, group=self.group)
        # As in torch: whether this step synchronizes is decided here, at forward.
        self._step_syncs = torch.is_grad_enabled() and self._sync
        self._sync_buffers_next = self._step_syncs
        self._reset()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Forward and backward inside accumulate gradients locally, with no all-reduce."""
        before, self._sync = self._backwards, False
        try:
            yield
        finally:
            self._sync = True
        if self._backwards == before:
            raise RuntimeError("no_sync() ended without a backward inside it: run forward *and* "
                               "backward in it (a forward outside no_sync still synchronizes)")

    # ------------------------------------------------------------------- during backward
    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._queued:  # first gradient of this backward: run _finish when backward ends
            self._queued = True
            self._backwards += 1
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if not self._step_syncs:
            return
        if id(p) in self._ready:
            name = next(n for n, q in zip(self.names, self.params) if q is p)
            raise RuntimeError(f"parameter {name!r} got a second gradient "
                               "after one forward: run forward before each backward (accumulate "
                               "with no_sync)")
        k = self.bucket_of[id(p)]
        self._ready.add(id(p))
        self._arrived[k] += 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Start bucket all-reduces in bucket order, as far as the buckets are complete."""
        while self._next < len(self.buckets) and (
                force or self._arrived[self._next] == len(self.buckets[self._next])):
            self._launch(self._next)
            self._next += 1

    def _launch(self, k: int) -> None:
        flat, scale = self.flats[k], 1.0 / self.world if self.compress is None else 1.0
        for p, piece in zip(self.buckets[k], flat.split([p.numel() for p in self.buckets[k]])):
            if p.grad is None:  # unused here (find_unused_parameters): count as zero
                piece.zero_()
            else:  # copy into the bucket, divided by W on the way as torch does (one pass)
                torch.mul(p.grad.reshape(-1), scale, out=piece)
        if self.compress is not None:  # as torch's fp16/bf16 hooks: cast, then divide
            flat = self.sends[k].copy_(flat).div_(self.world)
        t0 = time.perf_counter()
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        done: list[float] = []
        if self.timeline is not None:
            work.get_future().then(lambda _: done.append(time.perf_counter()))
        self._works.append((k, flat, work, t0, done))

    def _end_backward(self) -> None:
        """Run at the end of every backward: ``_finish``, then wait until no gloo thread holds a
        buffer (once ``_finish`` has returned, its works and views of the buffers are gone)."""
        self._finish()
        let_go(self.flats + self.sends + [self._used])   # see the module's docstring

    def _finish(self) -> None:
        self._queued = False
        if not self._step_syncs:
            return
        missing = [n for n, p in zip(self.names, self.params) if id(p) not in self._ready]
        if missing and not self.find_unused:
            raise RuntimeError(f"parameters {missing} got no gradient in this backward, so their "
                               "buckets can never be all-reduced. Use every parameter in the loss, "
                               "freeze them (requires_grad_(False)), or pass "
                               "find_unused_parameters=True")
        self._launch_ready(force=True)
        used = None
        if self.find_unused:  # a parameter unused on every rank keeps grad None, as in torch
            self._used.copy_(torch.tensor([float(id(p) in self._ready) for p in self.params]))
            dist.all_reduce(self._used, group=self.group)
            used = {id(p): u > 0 for p, u in zip(self.params, self._used)}
        for k, flat, work, t0, done in self._works:
            work.wait()
            if self.timeline is not None:
                self.timeline.add(f"rank {self.rank} comm", f"bucket {k}", t0,
                                  done[0] if done else time.perf_counter())
            out = flat.to(self.params[0].dtype) if self.compress is not None else flat
            for p, piece in zip(self.buckets[k], out.split([q.numel() for q in self.buckets[k]])):
                if used is not None and not used[id(p)]:
                    continue
                if p.grad is None:
                    p.grad = piece.view_as(p).clone()
                else:
                    p.grad.copy_(piece.view_as(p))
        self._works = []

    def close(self) -> bool:
        """Wait for every all-reduce this DDP started (a backward cut short by an error leaves
        some), drop them, and return once no gloo thread holds a buffer of this DDP (False if one
        still did after 2 s): call it before ``destroy_process_group`` when a step may have ended
        early."""
        works, self._works = [work for _, _, work, _, _ in self._works], []
        return drain(works, self.flats + self.sends + [self._used])

    def pending(self) -> list[int]:
        """The buckets whose all-reduce is started and not yet waited for, or whose buffer
        something else still holds (a gloo thread, a view): ``[]`` after every backward."""
        started = {k for k, *_ in self._works}
        bufs = [[f] + ([self.sends[k]] if self.sends else []) for k, f in enumerate(self.flats)]
        return [k for k, b in enumerate(bufs) if k in started or any(map(held_elsewhere, b))]

    # ------------------------------------------------------------------- for the notebook
    def bucket_names(self) -> list[list[str]]:
        where = {id(p): n for n, p in zip(self.names, self.params)}
        return [[where[id(p)] for p in b] for b in self.buckets]

    def bucket_bytes(self) -> list[int]:
        return [sum(p.numel() * p.element_size() for p in b) for b in self.buckets]


class TiedToy(nn.Module):
    """A small model with the two cases that break naive DDPs: a frozen layer and tied weights.

    Token ids -> embedding -> Linear + ReLU -> frozen Linear -> Linear + ReLU -> output layer whose
    weight *is* the embedding's (one parameter used twice; its gradient is the sum of both uses).
    """

    def __init__(self, vocab: int = 32, dim: int = 16, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.frozen = nn.Linear(dim, dim).requires_grad_(False)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)
        self.out.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(self.embed(ids).mean(1)))
        return self.out(torch.relu(self.mix(self.frozen(h))))
