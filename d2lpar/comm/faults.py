"""Faults planted on purpose, each a function to run on 2-4 launched ranks, each ending on its own.

Hangs and mismatches (run with ``launch(..., init_process_group=False)``: each sets up its own group):

* ``skip_collective``: rank ``skipper`` (1) skips one all-reduce that the others call. Collectives pair up by order,
  not by line: rank 1's next all-reduce completes rank 0's skipped one, and the hang appears one
  collective later (the others in an all-reduce, the skipper in the final barrier). ``how`` = 'hang' waits
  (the launcher's timeout shows each rank's stack); 'monitored' calls ``dist.monitored_barrier`` just
  before the suspect, which names the rank that did not arrive; 'recorded' gives the group a short
  timeout and dumps the flight recorder (``d2lpar.comm.flight_recorder``) on every rank.
* ``mismatch``: the ranks disagree on one all-reduce: 'order' (all-reduce and broadcast in opposite
  orders), 'shape' (4 against 6 elements), 'dtype' (float32 against int32, the same bytes).

Training faults (DDP on a tiny model, launched normally): ``uneven_batches`` (one rank has a batch
more; ``fix`` = 'join' or 'equal'), ``unused_parameter`` (a layer the forward skips;
``find_unused``). Silent errors, each returning what a check can test: ``dropout_masks``
(``seed_per_rank``), ``sampler_orders`` (``set_epoch``), ``manual_data_parallel_step``
(``average``), ``device_for`` (LOCAL_RANK or RANK on a second node) and ``nan_step`` (``guard``).

A mode a fault does not know (``how``, ``kind``, ``fix``), a ``timeout_s`` that is not a positive
number, or no writable ``folder`` for 'recorded' is refused in one sentence: by ``launch``, in the
caller before any rank starts (it calls a function's ``check_arguments``), and in each rank when the
fault is called there directly; a mode it did not know would plant a hang instead.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["skip_collective", "mismatch", "uneven_batches", "unused_parameter", "dropout_masks",
           "sampler_orders", "manual_data_parallel_step", "device_for", "nan_step"]


def _said(e: Exception) -> str:
    """The error's first line, whole, without the C++ source location gloo puts in front of it."""
    return re.sub(r"\[/\S+\] ", "", str(e).splitlines()[0])


def _init(timeout_s: float) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank()


def _checked(check):
    """Decorate a fault with ``check(**its arguments by name)``, run before the fault: by ``launch``
    in the caller, before any rank starts (as ``fault.check_arguments``), and in the rank itself."""
    def decorate(fault):
        signature = inspect.signature(fault)

        def check_arguments(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            check(**bound.arguments)

        @functools.wraps(fault)
        def checked(*args, **kwargs):
            check_arguments(*args, **kwargs)
            return fault(*args, **kwargs)
        checked.check_arguments = check_arguments
        return checked
    return decorate


def _one_of(name: str, value, known: tuple) -> None:
    if value not in known:
        said = ", ".join(map(repr, known[:-1])) + f" or {known[-1]!r}"
        raise ValueError(f"{name}={value!r}: use {said}")


def _check_timeout(timeout_s) -> None:
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
            or not 0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s={timeout_s!r}: give the seconds a collective may wait, a "
                         "number above 0")


def _check_skip(how, folder, timeout_s, skipper, **_) -> None:
    _one_of("how", how, ("hang", "monitored", "recorded"))
    _check_timeout(timeout_s)
    if isinstance(skipper, bool) or not isinstance(skipper, int):
        raise ValueError(f"skipper={skipper!r}: give the rank (a whole number) that skips a "
                         "collective")
    if how != "recorded":
        return
    if not isinstance(folder, (str, os.PathLike)):
        raise ValueError(f"how='recorded' writes each rank's dump into a folder, got "
                         f"folder={folder!r}: give a folder you can write")
    try:   # made now, as dump() would make it, and written to once
        Path(folder).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ValueError(f"folder={str(folder)!r} cannot be written ({e.strerror}): give a folder "
                         "you can write") from None


def _check_mismatch(kind, timeout_s) -> None:
    _one_of("kind", kind, ("order", "shape", "dtype"))
    _check_timeout(timeout_s)


def _check_uneven(fix) -> None:
    _one_of("fix", fix, (None, "join", "equal"))


@_checked(_check_skip)
def skip_collective(how: str = "hang", folder: str | None = None, run: str = "",
                    timeout_s: float = 60,
                    skipper: int = 1):
    """Every rank but ``skipper`` calls collective 3 (see the module's docstring for ``how``)."""
    rank = _init(timeout_s)
    t = torch.ones(4)
    dist.all_reduce(t)                 # collective 1: everyone
    dist.broadcast(t, 0)               # collective 2: everyone
    error = None
    try:
        if rank != skipper:
            if how == "monitored":     # placed just before the collective under suspicion
                dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
            dist.all_reduce(t)         # collective 3: the skipper skips it (a branch on the rank)
        dist.all_reduce(torch.ones(4))   # the next one for all: the skipper's pairs with the 3rd
        dist.barrier()                 # the epoch's end: the others are still in their all-reduce
    except RuntimeError as e:
        error = _said(e)
    if how == "recorded":
        from d2lpar.comm.flight_recorder import dump
        dump(folder, run)
    dist.destroy_process_group()       # no closing barrier: the peers disagree by now
    return error


@_checked(_check_mismatch)
def mismatch(kind: str, timeout_s: float = 5):
    rank = _init(timeout_s)
    result = None
    try:
        if kind == "order":
            a, b = torch.full((4,), rank + 1.0), torch.full((4,), 10.0 * (rank + 1))
            ops = [lambda: dist.all_reduce(a), lambda: dist.broadcast(b, 0)]
            for op in (ops if rank == 0 else ops[::-1]):
                op()
            result = (a.tolist(), b.tolist())
        elif kind == "shape":
            t = torch.ones(4 + 2 * rank)
            dist.all_reduce(t)
            result = t.tolist()
        elif kind == "dtype":
            t = torch.ones(4) if rank == 0 else torch.ones(4, dtype=torch.int32)
            dist.all_reduce(t)
            result = t.tolist()
        else:
            raise ValueError(f"kind={kind!r}: use 'order', 'shape' or 'dtype'")
    except RuntimeError as e:
        result = "error: " + _said(e)
        if kind == "order":   # keep the connection open until the slower peer has its own timeout
            _wait_for_peers(rank, 2 * timeout_s)
    dist.destroy_process_group()
    return result


def _wait_for_peers(rank: int, deadline_s: float) -> None:
    """Say 'done' in the group's store and wait (up to a deadline) until every rank has: a rank
    that destroyed its group at once would turn a slower peer's timeout into 'connection closed'."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"fault_done_{rank}", "1")
    try:
        store.wait([f"fault_done_{r}" for r in range(dist.get_world_size())],
                   timedelta(seconds=deadline_s))
    except RuntimeError:
        pass  # the peer is gone or slower than the deadline: nothing more to keep open for


def _ddp_model(seed: int = 0, branch: bool = False):
    torch.manual_seed(seed)
    model = nn.ModuleDict({"body": nn.Linear(4, 4), "unused": nn.Linear(4, 4)}) if branch else nn.Linear(4, 4)
    return model


class _SkipsALayer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.body(x).sum(-1, keepdim=True)   # self.head never runs


@_checked(_check_uneven)
def uneven_batches(fix: str | None = None):
    """DDP over a hand-made split (every N-th example, no padding): rank 0 has one batch more."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, n = dist.get_rank(), dist.get_world_size()
    data = torch.randn(7 * n + 1, 4, generator=torch.Generator().manual_seed(0))  # one more
    mine = data[rank::n]
    if fix == "equal":  # what DistributedSampler(drop_last=True) does: cut to the shortest
        mine = mine[: len(data) // n]
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    context = Join([model]) if fix == "join" else _nothing()
    with context:
        for x in mine.split(1):        # batches of one example
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            steps += 1
    return steps


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def unused_parameter(find_unused: bool = False, steps: int = 2):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(_SkipsALayer(), find_unused_parameters=find_unused)
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
    return steps


def dropout_masks(seed_per_rank: bool):
    """The dropout mask this rank draws after seeding (every rank alike, or seed + rank)."""
    torch.manual_seed(0 + (dist.get_rank() if seed_per_rank else 0))
    return nn.functional.dropout(torch.ones(16), 0.5) > 0


def sampler_orders(set_epoch: bool, epochs: int = 2):
    """The order this rank's DistributedSampler gives in each epoch."""
    from torch.utils.data import DistributedSampler
    sampler = DistributedSampler(range(16), shuffle=True, seed=0)
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def manual_data_parallel_step(average: bool, lr: float = 0.1):
    """One SGD step of data parallelism written by hand: all-reduce the gradients, then step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    X = torch.randn(4 * n, 4, generator=torch.Generator().manual_seed(1))
    nn.functional.mse_loss(model(X.chunk(n)[rank]), torch.zeros(4, 1)).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)            # a SUM over ranks
        if average:
            p.grad /= n
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return {k: v.detach() for k, v in model.state_dict().items()}


def device_for(env: dict[str, str], use_local_rank: bool) -> str:
    """The GPU a process picks from its launcher's variables: cuda:LOCAL_RANK, or cuda:RANK (wrong)."""
    return f"cuda:{env['LOCAL_RANK'] if use_local_rank else env['RANK']}"


def nan_step(guard: bool):
    """Rank 1's gradient is NaN (a bad batch). Unguarded, the all-reduce spreads it to every rank;
    guarded, the ranks first agree whether every gradient is finite, name the ranks that are not,
    and all skip the step."""
    rank = dist.get_rank()
    grad = torch.ones(3) * (float("nan") if rank == 1 else 1.0)
    if guard:
        finite = torch.tensor([float(torch.isfinite(grad).all())])
        flags = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, finite)
        bad = [r for r, f in enumerate(flags) if f.item() == 0]
        if bad:
            return {"skipped": True, "bad_ranks": bad, "grad": None}
    dist.all_reduce(grad)
    return {"skipped": False, "bad_ranks": [], "grad": grad.tolist()}
