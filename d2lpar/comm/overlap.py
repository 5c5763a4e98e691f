"""Overlapping computation with communication: compute while copying, not compute then copy.

Computing uses arithmetic units; copying uses a bus, a copy engine or a network. When the two do not
depend on each other they can run at the same time, and

    t_sequential = t_compute + t_transfer,      t_overlapped >= max(t_compute, t_transfer).

``OverlapResult.ratio`` = t_overlapped / max(t_compute, t_transfer): 1 is perfect overlap; with
t_compute = t_transfer, 2 means none. Each experiment checks that the overlapped run computes and
delivers exactly what the sequential one does: overlap may change *when*, never *what*.

``measure`` is the one harness every experiment uses: four cases (compute alone, transfer alone,
one after the other, overlapped), timed in interleaved rounds, best of each kept.

Four ways to get it:

* ``simulated_overlap`` (the one to read first on a CPU): the compute runs on a *simulated device*,
  a thread that waits as long as the real compute was measured to take (a GPU's kernels leave the
  CPU free in the same way), while a copy thread moves a real buffer. It needs one free core, so
  it shows the mechanism even on a busy machine.
* ``cpu_overlap``: on the CPU, the "transfer" is a copy of a large buffer (the gradient bucket a
  rank would send) done by a copy thread with one torch thread, while the main thread computes with
  one torch thread; each gets a core of its own.
* ``gloo_overlap_worker`` (run it with ``d2lpar.processes.launch``): an asynchronous gloo all-reduce
  (``async_op=True`` returns a handle at once; gloo works in its own thread) while the rank
  computes.
* ``cuda_overlap``: the compute stream produces ``y[i]`` while a second stream copies ``y[i-1]`` to
  pinned host memory with ``non_blocking=True``; an event orders each copy after its producer, and
  ``record_stream`` keeps the caching allocator from reusing ``y[i]`` before its copy ends.

``prefetch`` applies the same pattern to input batches: the copy of batch i+1 to the GPU runs on a
side stream while the default stream computes on batch i. ``pin_memory=True`` and
``non_blocking=True`` alone are not enough: a copy queued on the *default* stream runs after the
compute queued before it, so nothing overlaps; the side stream is what lets the two run together.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from d2lpar.infra.timing import Timeline
from d2lpar.infra.verdict import overlap_verdict
from d2lpar.infra.workers import torch_threads

__all__ = ["OverlapResult", "matmul_loop", "measure", "simulated_overlap", "cpu_overlap",
           "gloo_overlap_worker", "cuda_overlap", "prefetch", "unsynchronized_readback"]


@dataclass
class OverlapResult:
    """Four times (seconds) and the timelines of the sequential and the overlapped run."""
    name: str
    compute: float
    transfer: float
    sequential: float
    overlapped: float
    timelines: dict[str, Timeline] = field(default_factory=dict)
    what: str = "transfer"      # the names the verdict uses for the two jobs
    behind: str = "compute"

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

    def verdict(self) -> str:
        """The conclusion of this run, from its own numbers (``d2lpar.infra.verdict``)."""
        return overlap_verdict(self.overlapped, self.compute, self.transfer, what=self.what,
                               behind=self.behind)

    def table(self) -> str:
        """The four times, the limit and the ratio, ending with the verdict of this run."""
        lines = [f"{self.name}"] + [f"  {k:<30}{v * 1e3:9.1f} ms" for k, v in self.rows()]
        lines.append(f"  ratio overlapped / max(compute, transfer) = {self.ratio:.3f}")
        lines.append(f"  {self.verdict()}")
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

    ``before`` runs ahead of every timed run (a barrier, a ``cuda.synchronize``) and again before
    the clock stops, so queued device work is counted; ``check`` runs after each overlapped run and
    raises if it computed or delivered anything different. The timelines kept are those of the last
    round, the same round on every rank, so spans drawn from several ranks belong together.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: time each case at least once")
    cases = {"compute": compute, "transfer": transfer, "sequential": sequential,
             "overlapped": overlapped}
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


def _calibrate(x: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, target_s: float,
               compute_steps: int | None, copies: int | None) -> tuple[int, int]:
    """Matrix products and copies that take about ``target_s`` each on one core (warm)."""
    matmul_loop(x, 3), _copy_chunks(dst, src, 1)  # warm up
    if compute_steps is None:
        t0 = time.perf_counter(); matmul_loop(x, 20)
        compute_steps = max(1, round(target_s / ((time.perf_counter() - t0) / 20)))
    if copies is None:
        t0 = time.perf_counter(); _copy_chunks(dst, src, 2)
        copies = max(1, round(target_s / ((time.perf_counter() - t0) / 2)))
    return compute_steps, copies


def _buffers(size: int, copy_mb: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=gen) / size ** 0.5
    src = torch.randn(int(copy_mb * 2 ** 20 / 4), generator=gen)
    return x, src, torch.empty_like(src)


def simulated_overlap(target_s: float = 0.05, size: int = 256, copy_mb: float = 32.0,
                      repeats: int = 5, device_s: float | None = None,
                      copies: int | None = None) -> OverlapResult:
    """Compute on a simulated device while a copy thread moves ``copy_mb`` MB buffers.

    The device is a thread that waits ``device_s`` seconds: by default the time that real matrix
    products sized to ``target_s`` were just measured to take on one core. A wait leaves the CPU
    free, as a GPU's kernels do, so the copy (real, and checked) needs only one free core.
    """
    if repeats < 1 or target_s <= 0 or copy_mb <= 0 or (device_s is not None and device_s <= 0):
        raise ValueError("simulated_overlap needs repeats >= 1, target_s > 0, copy_mb > 0 and "
                         "device_s > 0 (or None to measure it)")
    x, src, dst = _buffers(size, copy_mb)
    with torch_threads(1):
        steps, copies = _calibrate(x, dst, src, target_s, None, copies)
        if device_s is None:  # the device time stands for these products: measure them
            t0 = time.perf_counter(); matmul_loop(x, steps); device_s = time.perf_counter() - t0

        def compute(tl: Timeline, lane: str = "device (simulated)") -> None:
            with tl.span(lane, "compute (device time)"):
                time.sleep(device_s)  # the CPU is free meanwhile, as while a GPU computes

        def copy(tl: Timeline, lane: str = "copy thread") -> None:
            with tl.span(lane, "copy"):
                _copy_chunks(dst, src, copies)

        def sequential(tl: Timeline) -> None:
            compute(tl); copy(tl)

        def overlapped(tl: Timeline) -> None:
            dst.zero_()
            device = threading.Thread(target=compute, args=(tl,), name="simulated-device")
            device.start(); copy(tl); device.join()  # the copy runs while the device computes

        def check() -> None:
            if not torch.equal(dst, src):
                raise AssertionError("the overlapped copy delivered different numbers")

        result = measure(f"simulated device: {device_s * 1e3:.1f} ms of compute | copy thread, "
                         f"{copies} x {copy_mb:g} MB", compute, copy, sequential, overlapped,
                         repeats, check=check)
    result.timelines = {"compute then copy": result.timelines["sequential"],
                        "compute while copying": result.timelines["overlapped"]}
    result.what = "copy"
    return result


def cpu_overlap(target_s: float = 0.05, size: int = 256, copy_mb: float = 32.0, repeats: int = 5,
                compute_steps: int | None = None, copies: int | None = None) -> OverlapResult:
    """Compute (main thread) while a copy thread moves ``copy_mb`` MB buffers, on one core each.

    Without ``compute_steps``/``copies`` both jobs are sized to take about ``target_s`` seconds.
    Each of the four times is the best of ``repeats`` interleaved runs.
    """
    if repeats < 1 or target_s <= 0 or copy_mb <= 0:
        raise ValueError("cpu_overlap needs repeats >= 1, target_s > 0 and copy_mb > 0")
    x, src, dst = _buffers(size, copy_mb)
    with torch_threads(1):
        compute_steps, copies = _calibrate(x, dst, src, target_s, compute_steps, copies)
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
    result.what = "copy"
    return result


def gloo_overlap_worker(numel: int = 2 ** 22, size: int = 256, compute_steps: int = 100,
                        repeats: int = 3) -> OverlapResult:
    """Run under ``d2lpar.processes.launch``: an async all-reduce of ``numel`` floats beside
    compute.

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

    result = measure(f"rank {rank}: async all-reduce of {numel * 4 / 2 ** 20:g} MB beside "
                     f"{compute_steps} matmuls", compute, transfer, sequential, overlapped, repeats,
                     before=dist.barrier, check=check)
    result.what = "all-reduce"
    return result


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


def prefetch(batches, device: torch.device | str):
    """Yield each batch (a tuple of tensors) on ``device``; on a GPU, copy batch i+1 on a side
    stream while the default stream computes on batch i.

    The copy of the next batch is queued on ``side`` only after the compute stream has been told
    to wait for the current one, so the compute never waits for a copy it does not need. Host
    tensors are pinned first (a ``DataLoader(pin_memory=True)`` already gives pinned batches):
    only from pinned memory can a ``non_blocking`` copy run beside the kernels.
    """
    device = torch.device(device)
    if device.type != "cuda":  # no streams: each batch is copied when it is needed
        for batch in batches:
            yield tuple(t.to(device) for t in batch)
        return
    compute, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)

    def start_copy(batch):
        with torch.cuda.stream(side):
            return tuple((t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
                         for t in batch)

    it = iter(batches)
    first = next(it, None)
    if first is None:
        return
    ready = start_copy(first)
    for batch in it:
        compute.wait_stream(side)        # kernels queued from now on wait for batch i's copy
        for t in ready:
            t.record_stream(compute)     # its memory stays reserved while the compute uses it
        current, ready = ready, start_copy(batch)  # batch i+1 copies while batch i computes
        yield current
    compute.wait_stream(side)
    for t in ready:
        t.record_stream(compute)
    yield ready


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
    late = bool((host > 1).all())
    return {"complete before synchronize": early, "complete after synchronize": late}
