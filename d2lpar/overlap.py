"""Overlapping computation with communication: compute while copying, not compute then copy.

Computing uses arithmetic units; copying uses a bus, a copy engine or a network. When the two do not
depend on each other they can run at the same time, and

    t_sequential = t_compute + t_transfer,      t_overlapped >= max(t_compute, t_transfer).

``OverlapResult.ratio`` = t_overlapped / max(t_compute, t_transfer): 1 is perfect overlap; with
t_compute = t_transfer, 2 means none. Each experiment checks that the overlapped run computes and
delivers exactly what the sequential one does: overlap may change *when*, never *what*.

Three ways to get it:

* ``cpu_overlap``: on the CPU, the "transfer" is a copy of a large buffer (the gradient bucket a
  rank would send) done by a copy thread with one torch thread, while the main thread computes with
  one torch thread; each gets a core of its own.
* ``gloo_overlap_worker`` (run it with ``d2lpar.launch``): an asynchronous gloo all-reduce
  (``async_op=True`` returns a handle at once; gloo works in its own thread) while the rank computes.
* ``cuda_overlap``: the compute stream produces ``y[i]`` while a second stream copies ``y[i-1]`` to
  pinned host memory with ``non_blocking=True``; an event orders each copy after its producer, and
  ``record_stream`` keeps the caching allocator from reusing ``y[i]`` before its copy ends.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from .timing import Timeline
from .workers import torch_threads

__all__ = ["OverlapResult", "matmul_loop", "cpu_overlap", "gloo_overlap_worker", "cuda_overlap",
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


def _best(times: list[float]) -> float:
    return min(times)  # the least disturbed run, as timeit reports


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
        expected = matmul_loop(x, compute_steps)
        times: dict[str, list[float]] = {k: [] for k in ("c", "t", "s", "o")}
        timelines: dict[str, Timeline] = {}
        for _ in range(repeats):
            t0 = time.perf_counter(); matmul_loop(x, compute_steps)
            t1 = time.perf_counter(); _copy_chunks(dst, src, copies)
            t2 = time.perf_counter()
            times["c"].append(t1 - t0); times["t"].append(t2 - t1)
            seq = Timeline()
            t0 = time.perf_counter(); y = matmul_loop(x, compute_steps)
            t1 = time.perf_counter(); _copy_chunks(dst, src, copies)
            t2 = time.perf_counter()
            seq.add("main thread", "compute", t0, t1); seq.add("main thread", "copy", t1, t2)
            times["s"].append(t2 - t0)
            if t2 - t0 <= _best(times["s"]):
                timelines["compute then copy"] = seq
            dst.zero_()
            over, marks = Timeline(), {}
            def copier():
                marks["a"] = time.perf_counter(); _copy_chunks(dst, src, copies)
                marks["b"] = time.perf_counter()
            t0 = time.perf_counter()
            th = threading.Thread(target=copier, name="copy-thread")
            th.start(); y = matmul_loop(x, compute_steps); t1 = time.perf_counter(); th.join()
            t2 = time.perf_counter()
            over.add("main thread", "compute", t0, t1)
            over.add("copy thread", "copy", marks["a"], marks["b"])
            times["o"].append(t2 - t0)
            if not (torch.equal(y, expected) and torch.equal(dst, src)):
                raise AssertionError("overlapped run computed or copied something different")
            if t2 - t0 <= _best(times["o"]):
                timelines["compute while copying"] = over
    return OverlapResult(f"CPU: {compute_steps} matmuls {size}x{size} | copy thread, "
                         f"{copies} x {copy_mb:g} MB", _best(times["c"]), _best(times["t"]),
                         _best(times["s"]), _best(times["o"]), timelines)


def gloo_overlap_worker(numel: int = 2 ** 22, size: int = 256, compute_steps: int = 100,
                        repeats: int = 3) -> dict:
    """Run under ``d2lpar.launch``: an async all-reduce of ``numel`` floats beside a compute loop.

    Returns this rank's best times (seconds), spans of its best overlapped run, and whether every
    all-reduce gave the same sum as the sequential one.
    """
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(size, size, generator=torch.Generator().manual_seed(rank)) / size ** 0.5
    grad = torch.full((numel,), float(rank + 1))
    expected = torch.full((numel,), float(world * (world + 1) // 2))
    ok, times, spans = True, {"c": [], "t": [], "s": [], "o": []}, []
    for _ in range(repeats):
        dist.barrier(); t0 = time.perf_counter(); matmul_loop(x, compute_steps)
        times["c"].append(time.perf_counter() - t0)
        buf = grad.clone(); dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(buf)
        times["t"].append(time.perf_counter() - t0); ok &= torch.equal(buf, expected)
        buf = grad.clone(); dist.barrier(); t0 = time.perf_counter()
        matmul_loop(x, compute_steps); dist.all_reduce(buf)
        times["s"].append(time.perf_counter() - t0); ok &= torch.equal(buf, expected)
        buf = grad.clone(); dist.barrier(); t0 = time.perf_counter()
        work = dist.all_reduce(buf, async_op=True)  # returns at once; gloo's thread does the work
        matmul_loop(x, compute_steps); t1 = time.perf_counter()
        work.wait(); t2 = time.perf_counter()
        times["o"].append(t2 - t0); ok &= torch.equal(buf, expected)
        if t2 - t0 <= min(times["o"]):
            spans = [(f"rank {rank} compute", "compute", t0, t1),
                     (f"rank {rank} gloo", "all-reduce in flight", t0, t2)]
    return {"compute": min(times["c"]), "transfer": min(times["t"]), "sequential": min(times["s"]),
            "overlapped": min(times["o"]), "spans": spans, "ok": bool(ok)}


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

    def timed(fn) -> float:
        torch.cuda.synchronize(device); t0 = time.perf_counter(); fn()
        torch.cuda.synchronize(device); return time.perf_counter() - t0

    def compute(reps):
        return [matmul_loop(x, reps) for _ in range(pieces)]

    def copy_all(ys):
        for h, y in zip(host, ys):
            h.copy_(y, non_blocking=True)

    if compute_reps is None:
        ys = compute(1); copy_all(ys)  # warm up
        per_rep, per_copy = timed(lambda: compute(1)), timed(lambda: copy_all(ys))
        compute_reps = max(1, round(per_copy / per_rep))
    ys = compute(compute_reps)
    expected = [y.cpu() for y in ys]
    timeline = Timeline()

    def overlapped():
        events = []
        for i in range(pieces):
            y = matmul_loop(x, compute_reps)
            done = torch.cuda.Event(enable_timing=True); done.record()
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_event(done)  # copy y[i] only after it has been computed
                host[i].copy_(y, non_blocking=True)
                y.record_stream(copy_stream)  # y's memory stays reserved until the copy is done
                end = torch.cuda.Event(enable_timing=True); end.record()
            events.append((done, end))
        return events

    times = {k: [] for k in ("c", "t", "s", "o")}
    for _ in range(repeats):
        times["c"].append(timed(lambda: compute(compute_reps)))
        times["t"].append(timed(lambda: copy_all(ys)))
        times["s"].append(timed(lambda: copy_all(compute(compute_reps))))
        for h in host:
            h.zero_()
        start = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device); t0 = time.perf_counter(); start.record()
        events = overlapped(); torch.cuda.synchronize(device)
        times["o"].append(time.perf_counter() - t0)
        if not all(torch.equal(h, e) for h, e in zip(host, expected)):
            raise AssertionError("the overlapped copies delivered different numbers")
    prev_done = prev_end = 0.0
    for done, end in events:  # spans of the last overlapped run, read from CUDA events
        d, e = start.elapsed_time(done) / 1e3, start.elapsed_time(end) / 1e3
        timeline.add("compute stream", "compute", prev_done, d)
        timeline.add("copy stream", "copy to host", max(d, prev_end), e)
        prev_done, prev_end = d, e
    return OverlapResult(f"CUDA {device}: {pieces} x {compute_reps} matmuls {size}x{size} | "
                         f"{pieces} pinned copies of {size * size * 4 / 2 ** 20:g} MB",
                         _best(times["c"]), _best(times["t"]), _best(times["s"]),
                         _best(times["o"]), {"compute while copying": timeline})


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
