"""Measuring DDP: how much of the all-reduce hides behind backward; d2lpar's DDP against torch's.

Three workers, each run on every rank by ``d2lpar.processes.launch`` (the bench and notebook 09 call
the same ones, so they print the same kind of figures):

* ``overlap_worker``: the four cases of ``d2lpar.comm.overlap.measure`` for one DDP step, and the
  CPU time the rank's process (all its threads) used in its fastest overlapped step.
  *compute* = forward + backward with no all-reduce (``no_sync``); *transfer* = what DDP adds to a
  step without the compute (``bucket_transfer``: each bucket's gradients copied into its flat
  buffer, its all-reduce started, then all waited for and the averages copied back);
  *sequential* = compute, then that same transfer, so it is compute + transfer by construction
  (the gradients its checks compare with are taken once, untimed, before the rounds);
  *overlapped* = the DDP step, each bucket's all-reduce started from the gradient hooks.
  ``ratio = overlapped / max(compute, transfer)``: 1 is perfect overlap. With
  ``device_time=True`` backward runs on a simulated device (``d2lpar.infra.device_time``): its
  layers' device times add up to ``compute_over_comm`` times the transfer time calibrated just
  before (the same ``bucket_transfer``), and the CPU stays free for gloo meanwhile, as it would with
  a GPU computing; gradients and messages stay real. The default, ``COMPUTE_OVER_COMM = 3``, is a
  backward well above its communication. ``comm_s`` given: the device time is scaled from it
  instead of a fresh calibration (a busy moment during the calibration would inflate the device
  time; notebook 09 passes the transfer an earlier run measured). The result holds ``comm_s`` and
  the table's compute and transfer rows, so a caller can print the compute/transfer ratio reached.
* ``versus_torch_worker``: step times (forward + backward + all-reduce) of d2lpar's DDP and
  ``torch.nn.parallel.DistributedDataParallel`` on the same model, data and bucket cap, real
  compute, in interleaved rounds, best of each; checks that both give the same gradients.
* ``sweep_worker``: the device-time backward + all-reduce for several bucket caps, backward alone,
  and ``bucket_transfer`` of one bucket of several sizes, to fit ``T(K) = a + K b`` for the cost
  model in ``d2lpar.cost.buckets``. T(K) is measured the way DDP spends it (copies in and out
  included), in the same run as the steps it predicts, so ``a`` holds the per-message latency of
  gloo on this machine as it is now.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

from d2lpar.comm.overlap import measure
from d2lpar.infra.device_time import record, set_backward_time, timed_mlp
from d2lpar.infra.models import mlp
from d2lpar.infra.timing import Timeline
from d2lpar.strategies.data.ddp import DDP

__all__ = ["overlap_worker", "versus_torch_worker", "sweep_worker", "model_and_data",
           "bucket_transfer", "COMPUTE_OVER_COMM"]

COMPUTE_OVER_COMM = 3.0  # device time of backward / all-reduce time, unless told otherwise


def model_and_data(width: int, depth: int, batch: int, seed: int = 0):
    """The timed MLP (same on every rank) and this rank's batch."""
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return timed_mlp(width, depth, seed=seed), x, y


def bucket_transfer(buckets, flats, world: int) -> None:
    """What DDP adds to a step, without the compute: each bucket's gradients copied into its flat
    buffer (divided by W on the way), its all-reduce started; then every all-reduce waited for and
    the averages copied back into the gradients. ``buckets``: lists of tensors holding gradients
    (parameters with ``.grad``, or plain tensors standing for gradients)."""
    grads = [[p.grad if isinstance(p, nn.Parameter) else p for p in b] for b in buckets]
    works = []
    for gs, flat in zip(grads, flats):
        for g, piece in zip(gs, flat.split([g.numel() for g in gs])):
            torch.mul(g.reshape(-1), 1.0 / world, out=piece)
        works.append(dist.all_reduce(flat, async_op=True))
    for gs, flat, work in zip(grads, flats, works):
        work.wait()
        for g, piece in zip(gs, flat.split([g.numel() for g in gs])):
            g.copy_(piece.view_as(g))


def _time_transfer(buckets, flats, rounds: int = 15) -> float:
    """Best time of ``bucket_transfer`` (as ``measure`` keeps the best of each case), the same on
    every rank (the larger of the ranks' figures). Single rounds vary by 2x on a shared CPU, so the
    best of many: a calibration from 5 rounds came out up to 2.6 times what the same all-reduces
    took later."""
    world, times = dist.get_world_size(), []
    for i in range(rounds + 3):
        dist.barrier()
        t0 = time.perf_counter()
        bucket_transfer(buckets, flats, world)
        if i >= 3:  # the first rounds warm up
            times.append(time.perf_counter() - t0)
    t = torch.tensor([min(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def overlap_worker(cap_mb: float = 1.0, width: int = 512, depth: int = 8, batch: int = 8,
                   compute_over_comm: float = COMPUTE_OVER_COMM, device_time: bool = True,
                   repeats: int = 5, comm_s: float | None = None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, x, y = model_and_data(width, depth, batch)
    ddp = DDP(model, cap_mb)
    flats = [torch.zeros(sum(p.numel() for p in b)) for b in ddp.buckets]
    with ddp.no_sync():  # gradients to copy: the transfer is timed on them
        nn.functional.cross_entropy(ddp(x), y).backward()
    if comm_s is None:  # calibrate now; given, the device time is scaled from it instead
        comm_s = _time_transfer(ddp.buckets, flats)
    shares = set_backward_time(model, compute_over_comm * comm_s if device_time else 0.0)
    lane_c, lane_n = f"rank {rank} compute", f"rank {rank} comm"
    saved: dict = {}

    def step(tl: Timeline) -> None:
        record(model, tl, lane_c)
        ddp.timeline = tl
        for p in model.parameters():
            p.grad = None
        with tl.span(lane_c, "forward"):
            loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()

    def compute(tl: Timeline) -> None:
        with ddp.no_sync():
            step(tl)

    def transfer(tl: Timeline) -> None:
        t0 = time.perf_counter()
        bucket_transfer(ddp.buckets, flats, world)
        tl.add(lane_n, "all buckets", t0, time.perf_counter())

    def sequential(tl: Timeline) -> None:
        compute(tl)
        transfer(tl)

    def check() -> None:
        for p, e in zip(model.parameters(), saved["expected"]):
            if not torch.allclose(p.grad, e, rtol=1e-6, atol=1e-7):
                raise AssertionError(f"rank {rank}: the overlapped step gave other gradients")

    cpu: list[tuple[float, float]] = []  # (wall, CPU of this process: every thread, gloo's too)

    def overlapped(tl: Timeline) -> None:
        w0, c0 = time.perf_counter(), time.process_time()
        step(tl)
        cpu.append((time.perf_counter() - w0, time.process_time() - c0))

    sequential(Timeline())  # untimed: the gradients every checked run must give, kept out of
    saved["expected"] = [p.grad.clone() for p in model.parameters()]  # the clock
    result = measure(f"rank {rank}: DDP step, {len(flats)} buckets", compute, transfer,
                     sequential, overlapped, repeats=repeats, before=dist.barrier, check=check,
                     checked=("sequential", "overlapped"))
    record(model, None)
    ddp.timeline = None
    return {"result": result, "comm_s": comm_s, "layer_s": shares,
            "bucket_bytes": ddp.bucket_bytes(),
            "step_cpu": min(cpu),  # the fastest overlapped step: its wall time and its CPU time
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def versus_torch_worker(cap_mb: float = 1.0, width: int = 512, depth: int = 8, batch: int = 64,
                        repeats: int = 10) -> dict:
    """Best step time of d2lpar's DDP and torch's, real compute, interleaved; equal gradients."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
    ours, theirs = (mlp((width,) * (depth + 1) + (10,)) for _ in range(2))
    wrapped = {"d2lpar": DDP(ours, cap_mb), "torch": TorchDDP(theirs, bucket_cap_mb=cap_mb)}
    best = {k: float("inf") for k in wrapped}
    for i in range(repeats + 2):  # two rounds warm up (torch rebuilds its buckets then)
        for name in sorted(wrapped, reverse=i % 2 == 1):  # alternate who goes first
            wrapped[name].zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            nn.functional.cross_entropy(wrapped[name](x), y).backward()
            if i >= 2:
                best[name] = min(best[name], time.perf_counter() - t0)
    same = all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
               for a, b in zip(ours.parameters(), theirs.parameters()))
    return {**best, "same_gradients": same}


def sweep_worker(caps_mb, width: int = 512, depth: int = 8, batch: int = 8,
                 compute_over_comm: float = COMPUTE_OVER_COMM, repeats: int = 5,
                 sizes=(4 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20)) -> dict:
    """Backward + all-reduce time per cap (device time), backward alone (both best of ``repeats``
    interleaved rounds, so a busy moment hits every cap alike), and T(K) of ``bucket_transfer`` for
    one bucket of each of ``sizes`` bytes, measured right after."""
    model, x, y = model_and_data(width, depth, batch)
    total = sum(p.numel() for p in model.parameters())
    backward_s = compute_over_comm * _time_transfer([[torch.zeros(total)]], [torch.zeros(total)])
    runs = {}  # one model per cap, and one more for backward alone: hooks are per DDP
    for cap in list(caps_mb) + [None]:
        model, _, _ = model_and_data(width, depth, batch)
        shares = set_backward_time(model, backward_s)
        runs[cap] = (model, DDP(model, cap or 25.0))
    best = {cap: float("inf") for cap in runs}
    for _ in range(repeats + 1):  # the first round warms up, and counts only if it is the best
        for cap, (model, ddp) in runs.items():
            model.zero_grad(set_to_none=True)
            with ddp.no_sync() if cap is None else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(ddp(x), y)
                dist.barrier()
                t0 = time.perf_counter()
                loss.backward()  # cap None: backward alone, the device time plus the real work
            best[cap] = min(best[cap], time.perf_counter() - t0)
    rows = [{"cap_mb": cap, "buckets": len(runs[cap][1].buckets), "step": best[cap]}
            for cap in caps_mb]
    # T(K) as DDP spends it: one bucket of K bytes copied in, all-reduced, copied out
    allreduce = [_time_transfer([[torch.zeros(s // 4)]], [torch.zeros(s // 4)]) for s in sizes]
    nbytes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in model]
    return {"rows": rows, "sizes": list(sizes), "allreduce": allreduce, "backward_s": backward_s,
            "compute": best[None],
            "layers": list(zip(shares, nbytes))[::-1]}  # in the order backward reaches them
