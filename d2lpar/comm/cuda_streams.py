"""The GPU's streams: computing on one CUDA stream while another copies, and the traps around it.

* ``cuda_overlap``: the compute stream produces ``y[i]`` while a second stream copies ``y[i-1]`` to
  pinned host memory with ``non_blocking=True``; an event orders each copy after its producer, and
  ``record_stream`` keeps the caching allocator from reusing ``y[i]`` before its copy ends. Timed
  with ``overlap.measure``, the harness every overlap experiment uses.
* ``prefetch`` applies the same pattern to input batches: the copy of batch i+1 to the GPU runs on a
  side stream while the default stream computes on batch i. ``pin_memory=True`` and
  ``non_blocking=True`` alone are not enough: a copy queued on the *default* stream runs after the
  compute queued before it, so nothing overlaps; the side stream is what lets the two run together.
* ``unsynchronized_readback``: what a host read of a result sees without a synchronize.
"""

from __future__ import annotations

import time

import torch

from d2lpar.comm.overlap import OverlapResult, matmul_loop, measure
from d2lpar.infra.timing import Timeline

__all__ = ["cuda_overlap", "prefetch", "unsynchronized_readback"]


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

    stamp = [0.0]  # changes every run: a copy that read a stale block would hold the old stamp

    def compute_all(reps):
        return [matmul_loop(x, reps).add_(stamp[0]) for _ in range(pieces)]

    def copy_all(ys):
        for h, y in zip(host, ys):
            h.copy_(y, non_blocking=True)

    if compute_reps is None:
        ys = compute_all(1); copy_all(ys); sync()  # warm up
        t0 = time.perf_counter(); compute_all(1); sync(); per_rep = time.perf_counter() - t0
        t0 = time.perf_counter(); copy_all(ys); sync(); per_copy = time.perf_counter() - t0
        compute_reps = max(1, round(per_copy / per_rep))
    ys = compute_all(compute_reps)
    base = matmul_loop(x, compute_reps).cpu()  # every piece before its stamp
    runs: list = []  # per overlapped run: its timeline, its start event, its (done, end) events

    def setup(case: str) -> None:  # untimed: fresh host buffers and a new stamp for every run
        for h in host:
            h.zero_()
        stamp[0] += 1.0

    def overlapped(tl: Timeline) -> None:
        start = torch.cuda.Event(enable_timing=True); start.record()
        marks = []
        for i in range(pieces):
            y = matmul_loop(x, compute_reps).add_(stamp[0])
            done = torch.cuda.Event(enable_timing=True); done.record()
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_event(done)  # copy y[i] only after it has been computed
                host[i].copy_(y, non_blocking=True)
                y.record_stream(copy_stream)  # y's memory stays reserved until the copy is done
                end = torch.cuda.Event(enable_timing=True); end.record()
            marks.append((done, end))
        runs.append((tl, start, marks))

    def check() -> None:
        expected = base + stamp[0]  # one float add, rounded the same on the host as on the GPU
        if not all(torch.equal(h, expected) for h in host):
            raise AssertionError("the copies delivered different numbers (a stale or early copy)")

    result = measure(f"CUDA {device}: {pieces} x {compute_reps} matmuls {size}x{size} | "
                     f"{pieces} pinned copies of {size * size * 4 / 2 ** 20:g} MB",
                     lambda tl: compute_all(compute_reps), lambda tl: copy_all(ys),
                     lambda tl: copy_all(compute_all(compute_reps)), overlapped, repeats,
                     before=sync, finish=sync, check=check, setup=setup,
                     checked=("sequential", "overlapped"))
    best = result.timelines["overlapped"]
    _, start, marks = next(run for run in runs if run[0] is best)  # the round of the table
    timeline, prev_done, prev_end = Timeline(), 0.0, 0.0
    for done, end in marks:  # spans of that overlapped run, read from CUDA events
        d, e = start.elapsed_time(done) / 1e3, start.elapsed_time(end) / 1e3
        timeline.add("compute stream", "compute", prev_done, d)
        timeline.add("copy stream", "copy to host", max(d, prev_end), e)
        prev_done, prev_end = d, e
    timeline.elapsed = best.elapsed
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
    if device.type != "cuda":  # no streams: each batch moves when it is needed (to its own
        for batch in batches:    # device, .to returns the tensor itself: no copy at all)
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
