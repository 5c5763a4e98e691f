"""Overlapping computation with communication: compute while copying, not compute then copy.

Computing uses arithmetic units; copying uses a bus, a copy engine or a network. When the two do not
depend on each other they can run at the same time, and

    t_sequential = t_compute + t_transfer,      t_overlapped >= max(t_compute, t_transfer).

``OverlapResult.ratio`` = t_overlapped / max(t_compute, t_transfer): 1 is perfect overlap; with
t_compute = t_transfer, 2 means none. Each experiment checks that the overlapped run computes and
delivers exactly what the sequential one does: overlap may change *when*, never *what*.

``measure`` is the one harness every experiment uses: four cases (compute alone, transfer alone,
one after the other, overlapped), timed in interleaved rounds, best of each kept.

Three ways to get it:

* ``cpu_overlap``: on the CPU, the "transfer" is a copy of a large buffer (the gradient bucket a
  rank would send) done by a copy thread with one torch thread, while the main thread computes with
  one torch thread; each gets a core of its own.
* ``gloo_overlap_worker`` (run it with ``d2lpar.processes.launch``): an asynchronous gloo all-reduce
  (``async_op=True`` returns a handle at once; gloo works in its own thread) while the rank computes.
* ``cuda_overlap``: the compute stream produces ``y[i]`` while a second stream copies ``y[i-1]`` to
  pinned host memory with ``non_blocking=True``; an event orders each copy after its producer, and
  ``record_stream`` keeps the caching allocator from reusing ``y[i]`` before its copy ends.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from d2lpar.infra.timing import Timeline
from d2lpar.infra.workers import torch_threads

__all__ = ["OverlapResult", "matmul_loop", "measure", "cpu_overlap", "gloo_overlap_worker", "cuda_overlap",
           "unsynchronized_readback"]


@dataclass
class OverlapResult:
    """Four times (seconds) and the timelines of the sequential and the overlapped run."""
    name: str
    compute: float
    transfer: float
    sequential: float
    overlapped: float
    timelines: dict[str, Timeline] = field(default_factory=dict)

    @property
    def bound(self) -> float:
        return max(self.compute, self.transfer)

    @property
    def ratio(self) -> float:
        return self.overlapped / self.bound

    def rows(self) -> list[tuple[str, float]]:
        return [("compute", self.compute), ("transfer", self.transfer),
                ("compute then transfer", self.sequential), ("overlapped", self.overlapped),
                ("limit max(compute, transfer)", self.bound)]

    def table(self) -> str:
        lines = [f"{self.name}"] + [f"  {k:<30}{v * 1e3:9.1f} ms" for k, v in self.rows()]
        lines.append(f"  ratio overlapped / max(compute, transfer) = {self.ratio:.3f}")
        return "\n".join(lines)


def matmul_loop(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The compute job: ``steps`` matrix products, each depending on the one before."""
    y = x
    for _ in range(steps):
        y = torch.tanh(y @ x)  # tanh keeps the values bounded over many steps
    return y


def _copy_chunks(dst: torch.Tensor, src: torch.Tensor, times: int) -> None:
    torch.set_num_threads(1)  # a thread starts with the default count: keep the copy on one core
    for _ in range(times):
        dst.copy_(src)


Run = Callable[[Timeline], None]  # one run of one case; it may record its spans in the timeline


def measure(name: str, compute: Run, transfer: Run, sequential: Run, overlapped: Run,
            repeats: int, before: Callable[[], None] = lambda: None,
            check: Callable[[], None] = lambda: None) -> OverlapResult:
    """The one harness: time the four cases in interleaved rounds and keep the best of each.

    ``before`` runs ahead of every timed run (a barrier, a ``cuda.synchronize``) and again before the
    clock stops, so queued device work is counted; ``check`` runs after each overlapped run and
    raises if it computed or delivered anything different. The timelines kept are those of the last
    round, the same round on every rank, so spans drawn from several ranks belong together.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: time each case at least once")
    cases = {"compute": compute, "transfer": transfer, "sequential": sequential, "overlapped": overlapped}
    best = {k: float("inf") for k in cases}
    timelines: dict[str, Timeline] = {}
    for _ in range(repeats):
        for key, run in cases.items():
            timeline = Timeline()
            before()
            t0 = time.perf_counter()
            run(timeline)
            before()
            best[key] = min(best[key], time.perf_counter() - t0)
            if key == "overlapped":
                check()
            if key in ("sequential", "overlapped"):
                timelines[key] = timeline
    return OverlapResult(name, best["compute"], best["transfer"], best["sequential"],
                         best["overlapped"], timelines)


def cpu_overlap(target_s: float = 0.05, size: int = 256, copy_mb: float = 32.0, repeats: int = 5,
                compute_steps: int | None = None, copies: int | None = None) -> OverlapResult:
    """Compute (main thread) while a copy thread moves ``copy_mb`` MB buffers, on one core each.

    Without ``compute_steps``/``copies`` both jobs are sized to take about ``target_s`` seconds.
    Each of the four times is the best of ``repeats`` interleaved runs.
    """
    if repeats < 1 or target_s <= 0 or copy_mb <= 0:
        raise ValueError("cpu_overlap needs repeats >= 1, target_s > 0 and copy_mb > 0")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=gen) / size ** 0.5
    src = torch.randn(int(copy_mb * 2 ** 20 / 4), generator=gen)
    dst = torch.empty_like(src)
    with torch_threads(1):
        matmul_loop(x, 3), _copy_chunks(dst, src, 1)  # warm up
        if compute_steps is None:
            t0 = time.perf_counter(); matmul_loop(x, 20)
            compute_steps = max(1, round(target_s / ((time.perf_counter() - t0) / 20)))
        if copies is None:
            t0 = time.perf_counter(); _copy_chunks(dst, src, 2)
            copies = max(1, round(target_s / ((time.perf_counter() - t0) / 2)))
        expected, out = matmul_loop(x, compute_steps), {}

        def compute(tl: Timeline) -> None:
            with tl.span("main thread", "compute"):
                out["y"] = matmul_loop(x, compute_steps)

        def copy(tl: Timeline, lane: str = "main thread") -> None:
            with tl.span(lane, "copy"):
                _copy_chunks(dst, src, copies)

        def sequential(tl: Timeline) -> None:
            compute(tl); copy(tl)

        def overlapped(tl: Timeline) -> None:
            dst.zero_()
            th = threading.Thread(target=copy, args=(tl, "copy thread"), name="copy-thread")
            th.start(); compute(tl); th.join()

        def check() -> None:
            if not (torch.equal(out["y"], expected) and torch.equal(dst, src)):
                raise AssertionError("overlapped run computed or copied something different")

        result = measure(f"CPU: {compute_steps} matmuls {size}x{size} | copy thread, "
                         f"{copies} x {copy_mb:g} MB", compute, copy, sequential, overlapped,
                         repeats, check=check)
    result.timelines = {"compute then copy": result.timelines["sequential"],
                        "compute while copying": result.timelines["overlapped"]}
    return result


def gloo_overlap_worker(numel: int = 2 ** 22, size: int = 256, compute_steps: int = 100,
                        repeats: int = 3) -> OverlapResult:
    """Run under ``d2lpar.processes.launch``: an async all-reduce of ``numel`` floats beside compute.

    Returns this rank's ``OverlapResult`` (lanes ``rank r compute`` and ``rank r gloo``); it raises
    if any all-reduce, overlapped or not, gives a different sum.
    """
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(size, size, generator=torch.Generator().manual_seed(rank)) / size ** 0.5
    grad = torch.full((numel,), float(rank + 1))
    expected = torch.full((numel,), float(world * (world + 1) // 2))
    buf = grad.clone()
    lane_c, lane_g = f"rank {rank} compute", f"rank {rank} gloo"

    def compute(tl: Timeline) -> None:
        with tl.span(lane_c, "compute"):
            matmul_loop(x, compute_steps)

    def transfer(tl: Timeline) -> None:
        buf.copy_(grad)
        with tl.span(lane_g, "all-reduce"):
            dist.all_reduce(buf)
        check()

    def sequential(tl: Timeline) -> None:
        compute(tl); transfer(tl)

    def overlapped(tl: Timeline) -> None:
        buf.copy_(grad)
        t0 = time.perf_counter()
        work = dist.all_reduce(buf, async_op=True)  # returns at once; gloo's thread does the work
        compute(tl)
        work.wait()
        tl.add(lane_g, "all-reduce in flight", t0, time.perf_counter())

    def check() -> None:
        if not torch.equal(buf, expected):
            raise AssertionError(f"rank {rank}: the all-reduce gave a different sum")

    return measure(f"rank {rank}: async gloo all-reduce of {numel * 4 / 2 ** 20:g} MB beside "
                   f"{compute_steps} matmuls", compute, transfer, sequential, overlapped, repeats,
                   before=dist.barrier, check=check)


def cuda_overlap(device: torch.device | str = "cuda", pieces: int = 16, size: int = 2048,
                 compute_reps: int | None = None, repeats: int = 5) -> OverlapResult:
    """Compute ``pieces`` results on ``device`` and copy each to pinned host memory.

    Sequential: every copy after all the compute, on the default stream. Overlapped: a second stream
    copies ``y[i-1]`` while the compute stream works on ``y[i]``. ``compute_reps`` (products per
    piece) defaults to the number that makes compute about as long as the copies.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("cuda_overlap needs a CUDA GPU; on the CPU use cpu_overlap")
    x = torch.randn(size, size, device=device) / size ** 0.5
    host = [torch.empty(size, size, pin_memory=True) for _ in range(pieces)]
    copy_stream = torch.cuda.Stream(device)
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731

    def compute_all(reps):
        return [matmul_loop(x, reps) for _ in range(pieces)]

    def copy_all(ys):
        for h, y in zip(host, ys):
            h.copy_(y, non_blocking=True)

    if compute_reps is None:
        ys = compute_all(1); copy_all(ys); sync()  # warm up
        t0 = time.perf_counter(); compute_all(1); sync(); per_rep = time.perf_counter() - t0
        t0 = time.perf_counter(); copy_all(ys); sync(); per_copy = time.perf_counter() - t0
        compute_reps = max(1, round(per_copy / per_rep))
    ys = compute_all(compute_reps)
    expected = [y.cpu() for y in ys]
    events: list = []

    def overlapped(tl: Timeline) -> None:
        for h in host:
            h.zero_()
        start = torch.cuda.Event(enable_timing=True); start.record()
        marks = []
        for i in range(pieces):
            y = matmul_loop(x, compute_reps)
            done = torch.cuda.Event(enable_timing=True); done.record()
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_event(done)  # copy y[i] only after it has been computed
                host[i].copy_(y, non_blocking=True)
                y.record_stream(copy_stream)  # y's memory stays reserved until the copy is done
                end = torch.cuda.Event(enable_timing=True); end.record()
            marks.append((done, end))
        events[:] = [start, marks]

    def check() -> None:
        if not all(torch.equal(h, e) for h, e in zip(host, expected)):
            raise AssertionError("the overlapped copies delivered different numbers")

    result = measure(f"CUDA {device}: {pieces} x {compute_reps} matmuls {size}x{size} | "
                     f"{pieces} pinned copies of {size * size * 4 / 2 ** 20:g} MB",
                     lambda tl: compute_all(compute_reps), lambda tl: copy_all(ys),
                     lambda tl: copy_all(compute_all(compute_reps)), overlapped, repeats,
                     before=sync, check=check)
    start, marks = events
    timeline, prev_done, prev_end = Timeline(), 0.0, 0.0
    for done, end in marks:  # spans of the last overlapped run, read from CUDA events
        d, e = start.elapsed_time(done) / 1e3, start.elapsed_time(end) / 1e3
        timeline.add("compute stream", "compute", prev_done, d)
        timeline.add("copy stream", "copy to host", max(d, prev_end), e)
        prev_done, prev_end = d, e
    result.timelines = {"compute while copying": timeline}
    return result


def unsynchronized_readback(device: torch.device | str = "cuda", size: int = 4096) -> dict:
    """What a non-blocking copy to the host holds if read before a synchronize, and after one."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("unsynchronized_readback needs a CUDA GPU")
    x = torch.ones(size, size, device=device)
    torch.cuda.synchronize(device)
    y = matmul_loop(x / size, 20) + 1.0  # every entry > 1 once computed
    host = y.to("cpu", non_blocking=True)  # pinned output; returns before the copy happens
    early = bool((host > 1).all())
    torch.cuda.synchronize(device)
    return {"complete before synchronize": early, "complete after synchronize": bool((host > 1).all())}
