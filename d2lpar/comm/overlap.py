"""Overlapping computation with communication: compute while copying, not compute then copy.

Computing uses arithmetic units; copying uses a bus, a copy engine or a network. When the two do not
depend on each other they can run at the same time, and

    t_sequential = t_compute + t_transfer,      t_overlapped >= max(t_compute, t_transfer).

``OverlapResult.ratio`` = t_overlapped / max(t_compute, t_transfer): 1 is perfect overlap; with
t_compute = t_transfer, 2 means none. Each experiment checks that the overlapped run computes and
delivers exactly what the sequential one does: overlap may change *when*, never *what*.

``measure`` is the one harness every experiment uses: four cases (compute alone, transfer alone,
one after the other, overlapped), timed in interleaved rounds, the best round of each kept
with its timeline.

Four ways to get it:

* ``simulated_overlap`` (the one to read first on a CPU): the compute runs on a *simulated device*,
  a thread that waits as long as the real compute was measured to take (a GPU's kernels leave the
  CPU free in the same way), while the main thread copies a real buffer. It needs one free core,
  so it shows the mechanism even on a busy machine.
* ``cpu_overlap``: on the CPU, the "transfer" is a copy of a large buffer (the gradient bucket a
  rank would send) done by a copy thread with one torch thread, while the main thread computes with
  one torch thread; each gets a core of its own.
* ``gloo_overlap_worker`` (run it with ``d2lpar.processes.launch``): an asynchronous gloo all-reduce
  (``async_op=True`` returns a handle at once; gloo works in its own thread) while the rank
  computes.
* ``cuda_streams.cuda_overlap``: the same four cases on a GPU, with a second CUDA stream copying
  (in its own module, with ``prefetch`` and ``unsynchronized_readback``: the GPU's streams).
"""

from __future__ import annotations

import textwrap
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from d2lpar.infra.timing import Timeline
from d2lpar.infra.verdict import busy_clause, hidden_fraction, overlap_verdict
from d2lpar.infra.workers import torch_threads

GAP_TOLERANCE = 0.15  # measured sequential vs compute + transfer: beyond it, no verdict

__all__ = ["OverlapResult", "matmul_loop", "measure", "simulated_overlap", "cpu_overlap",
           "gloo_overlap_worker"]


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

    @property
    def gap(self) -> float:
        """The measured sequential run against compute + transfer: 0 when the cases agree."""
        return self.sequential / (self.compute + self.transfer) - 1

    def consistent(self, tolerance: float = GAP_TOLERANCE) -> bool:
        """Whether the measured sequential run is within ``tolerance`` of compute + transfer."""
        return abs(self.gap) <= tolerance

    def readings(self) -> tuple[float, float | None]:
        """The share of the shorter job that hid (``hidden_fraction``), read twice: with compute +
        transfer as the sequential time, and with the measured sequential run (the longer job
        alone, plus the rest of that run as the shorter job); None where that rest is not
        positive."""
        first = hidden_fraction(self.overlapped, self.compute, self.transfer)
        rest = self.sequential - self.bound
        return first, (hidden_fraction(self.overlapped, self.bound, rest) if rest > 0 else None)

    def verdict(self) -> str:
        """The conclusion of this run, from its own numbers (``d2lpar.infra.verdict``).

        The run is read twice: with compute + transfer as the sequential time, and against the
        measured sequential run (the longer job alone, plus the rest of that run as the shorter
        job). The verdict is given only where both readings are of the same kind; where the
        measured sequential run is more than ``GAP_TOLERANCE`` away from compute + transfer, it
        says so. Where the readings differ, no verdict is given (with the busy clause where the
        machine was busy). A run below the limit is reported as that: time it again.
        """
        first = overlap_verdict(self.overlapped, self.compute, self.transfer, what=self.what,
                                behind=self.behind)
        if _reading(first) == "below the limit":  # that one already says: time them again
            return first
        rest = self.sequential - self.bound  # the shorter job, as the measured sequential run says
        if rest <= 0:  # no second reading: the sequential run was no longer than the longer job
            if self.consistent():
                return first
            second = "no reading (it was no longer than the longer job alone)"
        else:
            full = overlap_verdict(self.overlapped, self.bound, rest)
            second = _kind(full)
            if second == _kind(first):
                if self.consistent():
                    return first
                verdict, _, busy = first.partition("\n")  # the note before the busy clause
                if _reading(first) != "overlapped":  # the measured run's clause, e.g. its share
                    head, clause = verdict.split(": ", 1)[0], full.partition("\n")[0]
                    verdict = f"{head}: {clause.split(': ', 1)[1]}"
                return (f"{verdict}; read against the measured sequential run (off by "
                        f"{self.gap:+.0%}), the same kind" + (f"\n{busy}" if busy else ""))
        return (f"no verdict: the measured sequential run ({self.gap:+.0%} against compute + "
                f"transfer) gives a different reading: {_kind(first)} against the sum, "
                f"{second} against the measured run; time them again" + busy_clause())

    def table(self) -> str:
        """The four times, the limit and the ratio, ending with the verdict of this run.

        The measured sequential run is compared with compute + transfer; a gap above 15 % is
        flagged. The share of the shorter job that hid is printed for both readings, and the
        verdict is given only where the two readings are of the same kind.
        """
        lines = [f"{self.name}"] + [f"  {k:<30}{v * 1e3:9.1f} ms" for k, v in self.rows()]
        lines.append(f"  ratio overlapped / max(compute, transfer) = {self.ratio:.3f}")
        parts = self.compute + self.transfer
        lines.append(f"  overlapped / measured sequential = {self.overlapped / self.sequential:.3f}"
                     f" (saved {(self.sequential - self.overlapped) * 1e3:.1f} ms)")
        if not self.consistent():
            lines.append(f"  the sequential run took {self.gap:+.0%} against compute + transfer "
                         f"({parts * 1e3:.1f} ms): the cases saw different load")
        first, second = self.readings()
        lines.append(f"  hidden share of the shorter job: {first:.0%} (compute + transfer)"
                     + (f", {second:.0%} (measured sequential run)" if second is not None else ""))
        for part in self.verdict().splitlines():  # wrapped to 100 columns, its lines kept
            lines += textwrap.wrap(part.strip(), 98, initial_indent="  ", subsequent_indent="    ")
        return "\n".join(lines)


def _reading(verdict: str) -> str:
    """The kind of a verdict (``overlapped``, ``partly overlapped``, ``no overlap in this run``,
    ``below the limit``), without its figures."""
    return verdict.split(" (", 1)[0]


def _kind(verdict: str) -> str:
    """The kind of a verdict as ``_reading`` gives it, with "no overlap" split in two: the two
    slowed each other (longer than the sum) or as long as one after the other."""
    kind = _reading(verdict)
    if kind.startswith("no overlap"):
        slowed = "slowed each other" in verdict
        kind += ", the two slowed each other" if slowed else ", as long as one after the other"
    return kind


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
            check: Callable[[], None] = lambda: None,
            setup: Callable[[str], None] = lambda case: None,
            checked: tuple[str, ...] = ("overlapped",),
            finish: Callable[[], None] = lambda: None) -> OverlapResult:
    """The one harness: time the four cases in interleaved rounds and keep the best of each.

    ``before`` runs untimed ahead of every timed run: a barrier, so that the ranks start each case
    together, or a ``cuda.synchronize``, so that no earlier work is counted. ``finish`` runs
    before the clock stops: a ``cuda.synchronize``, so that queued device work is counted. A
    barrier does not belong there: it would add its own latency and the wait for the slower rank
    to this rank's time. ``check`` raises if a run computed or delivered anything different (it
    runs after each case named in ``checked``). ``setup(case)`` runs untimed before each run
    (zeroing the destination, copying the buffer in), so every case times the same work and
    nothing else. Each case reports its best round, and its timeline is the one of that same
    round (``timeline.elapsed`` holds that round's time), so a chart shows the run its table
    reports. Under a process group every rank must call ``measure`` (as a barrier in ``before``
    requires anyway): the ranks agree on one round per case, the one whose slowest rank was
    fastest, and each rank reports its own time in that round (from the barrier that started it
    to the end of its own run), so spans drawn from several ranks belong together.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: time each case at least once")
    cases = {"compute": compute, "transfer": transfer, "sequential": sequential,
             "overlapped": overlapped}
    times: dict[str, list[float]] = {k: [] for k in cases}
    rounds: dict[str, list[Timeline]] = {"sequential": [], "overlapped": []}
    for _ in range(repeats):
        for key, run in cases.items():
            timeline = Timeline()
            setup(key)                      # untimed: the same work is timed in every case
            before()
            t0 = time.perf_counter()
            run(timeline)
            finish()
            times[key].append(time.perf_counter() - t0)
            timeline.elapsed = times[key][-1]
            if key in checked:
                check()
            if key in rounds:
                rounds[key].append(timeline)
    pick = {k: _best_round(v) for k, v in times.items()}
    return OverlapResult(name, *(times[k][pick[k]] for k in cases),
                         {k: rounds[k][pick[k]] for k in rounds})


def _best_round(times: list[float]) -> int:
    """The round to report: the fastest; under a process group, the one whose slowest rank was
    fastest (the same round on every rank)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times = slowest.tolist()
    return min(range(len(times)), key=times.__getitem__)


def _calibrate(x: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, target_s: float,
               compute_steps: int | None, copies: int | None) -> tuple[int, int]:
    """Matrix products and copies that take about ``target_s`` each on one core (warm), sized
    from the best of three short timings: one timing on a busy machine can include a wait for a
    core, which would size the job too small."""
    matmul_loop(x, 3), _copy_chunks(dst, src, 1)  # warm up
    if compute_steps is None:
        per_step = _best_of(3, lambda: matmul_loop(x, 10)) / 10
        compute_steps = max(1, round(target_s / per_step))
    if copies is None:
        per_copy = _best_of(3, lambda: _copy_chunks(dst, src, 1))
        copies = max(1, round(target_s / per_copy))
    return compute_steps, copies


def _best_of(n: int, job: Callable[[], object]) -> float:
    """The shortest of ``n`` timings of ``job`` (seconds)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter(); job(); times.append(time.perf_counter() - t0)
    return min(times)


def _buffers(size: int, copy_mb: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=gen) / size ** 0.5
    src = torch.randn(int(copy_mb * 2 ** 20 / 4), generator=gen)
    return x, src, torch.empty_like(src)


def simulated_overlap(target_s: float = 0.05, size: int = 256, copy_mb: float = 32.0,
                      repeats: int = 5, device_s: float | None = None,
                      copies: int | None = None) -> OverlapResult:
    """Compute on a simulated device (a thread) while the main thread copies ``copy_mb`` MB buffers.

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
        if device_s is None:  # the device time stands for these products: measure them (best
            device_s = _best_of(3, lambda: matmul_loop(x, steps))  # of 3: waits for a core out)

        def compute(tl: Timeline, lane: str = "device (simulated)") -> None:
            with tl.span(lane, "compute (device time)"):
                time.sleep(device_s)  # the CPU is free meanwhile, as while a GPU computes

        def copy(tl: Timeline, lane: str = "main thread") -> None:
            with tl.span(lane, "copy"):
                _copy_chunks(dst, src, copies)

        def sequential(tl: Timeline) -> None:
            compute(tl); copy(tl)

        def overlapped(tl: Timeline) -> None:  # the device is a thread; the main thread copies
            device = threading.Thread(target=compute, args=(tl,), name="simulated-device")
            device.start(); copy(tl); device.join()  # the copy runs while the device computes

        def check() -> None:
            if not torch.equal(dst, src):
                raise AssertionError("the copy delivered different numbers")

        result = measure(f"simulated device: {device_s * 1e3:.1f} ms of compute | main thread, "
                         f"{copies} x {copy_mb:g} MB", compute, copy, sequential, overlapped,
                         repeats, check=check, setup=lambda case: dst.zero_(),
                         checked=("transfer", "sequential", "overlapped"))
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
            th = threading.Thread(target=copy, args=(tl, "copy thread"), name="copy-thread")
            th.start(); compute(tl); th.join()

        def setup(case: str) -> None:  # untimed, before every case: nothing computed or copied yet
            dst.zero_(); out.pop("y", None)

        def check() -> None:
            if not (torch.equal(out["y"], expected) and torch.equal(dst, src)):
                raise AssertionError("a run computed or copied something different")

        result = measure(f"CPU: {compute_steps} matmuls {size}x{size} | copy thread, "
                         f"{copies} x {copy_mb:g} MB", compute, copy, sequential, overlapped,
                         repeats, check=check, setup=setup, checked=("sequential", "overlapped"))
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
        with tl.span(lane_g, "all-reduce"):
            dist.all_reduce(buf)

    def sequential(tl: Timeline) -> None:
        compute(tl); transfer(tl)

    def overlapped(tl: Timeline) -> None:
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
                     before=dist.barrier, check=check, setup=lambda case: buf.copy_(grad),
                     checked=("transfer", "sequential", "overlapped"))
    result.what = "all-reduce"
    return result
