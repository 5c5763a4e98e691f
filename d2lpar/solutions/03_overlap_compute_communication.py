"""Worked solutions to the exercises of notebook 03 (overlapping computation with communication).

Each ``exercise_k`` computes its answer, prints it, and asserts what the answer claims. Exercise 3
needs a GPU; without one its solution runs the CPU variant it describes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from d2lpar.comm.overlap import cpu_overlap, measure
from d2lpar.infra.workers import torch_threads
from d2lpar.processes.launch import launch


def _copy_gbs(mb: float, repeats: int = 5) -> float:
    src = torch.randn(int(mb * 2 ** 20 / 4))
    dst = torch.empty_like(src)
    with torch_threads(1):
        dst.copy_(src)
        best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return src.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter(); fn(); return time.perf_counter() - t0


def exercise_1():
    """A 4 MB buffer (8 MB with its copy) fits in this CPU's last-level cache; 32 MB does not. The
    transfer *time* stays near target_s, since cpu_overlap sizes the number of copies to it; what
    changes is how many copies fit in it (the copy runs from cache, faster per byte) and, with less
    memory traffic against the compute thread, often the ratio."""
    for mb in (32, 4):
        r = cpu_overlap(target_s=0.03, copy_mb=mb, repeats=3)  # raises if anything was copied wrong
        print(f"{r.name}: transfer {r.transfer * 1e3:.1f} ms, ratio {r.ratio:.2f}")
    small, big = _copy_gbs(4), _copy_gbs(32)
    print(f"one thread copies {small:.1f} GB/s for 4 MB buffers, {big:.1f} GB/s for 32 MB buffers")
    assert small > 0.9 * big, "a cache-resident copy should not be slower per byte"


def _wait_worker(numel, compute_s, repeats, wait_first):
    rank = dist.get_rank()
    grad = torch.full((numel,), float(rank + 1))
    buf = grad.clone()

    def compute(tl):
        with tl.span(f"rank {rank} compute", "GPU compute (a sleep)"):
            time.sleep(compute_s)

    def transfer(tl):
        with tl.span(f"rank {rank} gloo", "all-reduce"):
            dist.all_reduce(buf)

    def overlapped(tl):
        t0 = time.perf_counter()
        work = dist.all_reduce(buf, async_op=True)
        ended = work.get_future().then(
            lambda _: tl.add(f"rank {rank} gloo", "all-reduce", t0, time.perf_counter()))
        if wait_first:
            work.wait(); ended.wait()
        compute(tl)
        work.wait(); ended.wait()

    r = measure(f"rank {rank}", compute, transfer, lambda tl: (compute(tl), transfer(tl)), overlapped,
                repeats, before=dist.barrier, setup=lambda case: buf.copy_(grad))
    return r, buf


def exercise_2():
    """work.wait() before the compute: the all-reduce must finish before the wait starts, so nothing
    overlaps and the "overlapped" time is the sequential one (ratio near (compute + transfer) / max)."""
    for wait_first in (False, True):
        results = launch(_wait_worker, 2, 2 ** 20, 0.03, 3, wait_first, quiet=True)
        total = sum(float(r + 1) for r in range(2))
        for r, buf in results:
            assert torch.equal(buf, torch.full_like(buf, total))
            spans = {s.label: s for s in r.timelines["overlapped"].spans}
            ar, wait = spans["all-reduce"], spans["GPU compute (a sleep)"]
            if wait_first:
                assert ar.end <= wait.start, "wait() first: the all-reduce ends before the compute starts"
            else:
                assert ar.start <= wait.start, "started first, the all-reduce runs beside the wait"
        r = results[0][0]
        print(f"work.wait() {'before' if wait_first else 'after'} the compute: overlapped {r.overlapped * 1e3:.1f} ms, "
              f"ratio {r.ratio:.2f} (no overlap would be {(r.compute + r.transfer) / r.bound:.2f})")


def exercise_3():
    """Needs a GPU. From pinned memory a non_blocking copy returns at once and runs on the copy engine;
    from pageable memory the copy goes through a staging buffer and the call returns only when it is
    done, so it cannot overlap. CPU variant: the staging costs a second copy of every byte."""
    if torch.cuda.is_available():
        y = torch.randn(4096, 4096, device="cuda")
        for pinned in (True, False):
            host = torch.empty(4096, 4096, pin_memory=pinned)
            host.copy_(y, non_blocking=True); torch.cuda.synchronize()
            returned = _timed(lambda: host.copy_(y, non_blocking=True))
            torch.cuda.synchronize()
            print(f"{'pinned' if pinned else 'pageable'} host memory: copy_(non_blocking=True) returned "
                  f"after {returned * 1e3:.2f} ms")
            if pinned:
                t_pinned = returned
        assert returned > t_pinned
        return
    src = torch.randn(8 * 2 ** 20)
    dst, stage = torch.empty_like(src), torch.empty_like(src)
    with torch_threads(1):
        direct = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
        staged = min(_timed(lambda: (stage.copy_(src), dst.copy_(stage))) for _ in range(5))
    print(f"no GPU here; CPU variant, 32 MB: direct copy {direct * 1e3:.1f} ms, through a staging buffer "
          f"{staged * 1e3:.1f} ms")
    assert torch.equal(dst, src) and staged > direct


def ring_allreduce_s(nbytes, n, bandwidth, latency=20e-6):
    return 2 * (n - 1) * (latency + nbytes / n / bandwidth)


def exercise_4():
    """Solve 2(N-1)(alpha + B / (N beta)) = t_backward for B: B = N beta (t / (2(N-1)) - alpha).
    The latency term eats more of the budget with 64 GPUs, so the break-even bucket is smaller."""
    t, beta, alpha = 30e-3, 100e9 / 8, 20e-6
    sizes = {}
    for n in (8, 64):
        sizes[n] = n * beta * (t / (2 * (n - 1)) - alpha)
        print(f"{n} GPUs: a bucket of {sizes[n] / 1e6:.0f} MB takes as long to all-reduce as the backward "
              f"pass ({ring_allreduce_s(sizes[n], n, beta) * 1e3:.1f} ms)")
        assert abs(ring_allreduce_s(sizes[n], n, beta) - t) < 1e-12
    grads = 97.5 * 2 ** 20  # ResNet-50's fp32 gradients, counted in the notebook
    print(f"both are larger than all of ResNet-50's gradients ({grads / 1e6:.0f} MB):\n"
          "  at 100 Gbit/s its whole all-reduce fits inside a 30 ms backward")
    assert sizes[64] < sizes[8] and min(sizes.values()) > grads
