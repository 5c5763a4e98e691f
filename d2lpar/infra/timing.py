"""Timing that tells the truth about asynchronous devices, and timelines of labelled spans.

A GPU runs a queue: ``y = x @ x`` returns as soon as the kernel is *queued*. A timer that does not
wait for the queue to drain measures the queueing, not the work. ``Timer`` and ``Benchmark`` here call
``synchronize(device)`` before reading the clock (d2l's do not). That waits for *one* device: the
one given, or with ``device=None`` only the current CUDA device. Work queued on a second GPU is not
waited for: synchronize every device used (``synchronize(d) for d in devices``) before reading.

A ``Timeline`` records spans ``(lane, label, start, end)``: one lane per device or rank. Spans use
``time.perf_counter()``, which on Linux and macOS reads the same monotonic clock in every process of
a machine, so spans recorded by different ranks can be put on one chart (``d2lpar.infra.plot``).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterable, NamedTuple

import torch

__all__ = ["load_line", "quiet_or_exit", "synchronize", "Timer", "Benchmark", "Span", "Timeline"]


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait until one device has finished its queued work (a no-op on the CPU).

    ``device=None`` waits for the *current* CUDA device only (if CUDA was initialized); call it once
    per device when work was queued on several.
    """
    device = torch.device(device) if device is not None else None
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class Timer:
    """Record several running times; ``start`` and ``stop`` synchronize ``device`` (one device;
    with ``None`` the current CUDA device) before reading the clock."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.times: list[float] = []
        self.start()

    def start(self) -> None:
        synchronize(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        synchronize(self.device)
        self.times.append(time.perf_counter() - self._t0)
        return self.times[-1]

    def avg(self) -> float:
        return sum(self.times) / len(self.times)

    def sum(self) -> float:
        return sum(self.times)

    def min(self) -> float:
        return min(self.times)


class Benchmark:
    """``with Benchmark('name', device):`` prints ``name: 0.1234 sec``; the time is in ``.elapsed``.

    It synchronizes ``device`` on entry and exit: one device (with ``None``, the current CUDA
    device). Work queued on other GPUs inside the block is not waited for.
    """

    def __init__(self, description: str = "Done", device: torch.device | str | None = None,
                 verbose: bool = True):
        self.description, self.device, self.verbose = description, device, verbose
        self.elapsed = float("nan")

    def __enter__(self) -> "Benchmark":
        synchronize(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.elapsed = time.perf_counter() - self._t0
        if self.verbose and exc[0] is None:
            print(f"{self.description}: {self.elapsed:.4f} sec")


class Span(NamedTuple):
    lane: str
    label: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    """Labelled spans of time, per lane (a device, a rank, a stream)."""

    def __init__(self, spans: Iterable[Span | tuple] = ()):
        self.spans: list[Span] = [Span(*s) for s in spans]

    @contextlib.contextmanager
    def span(self, lane: str, label: str, device: torch.device | str | None = None):
        """Record the time the body takes on ``lane``, synchronizing ``device`` at both ends."""
        synchronize(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(device)
            self.spans.append(Span(str(lane), label, start, time.perf_counter()))

    def add(self, lane: str, label: str, start: float, end: float) -> None:
        self.spans.append(Span(str(lane), label, start, end))

    def extend(self, other: "Timeline | Iterable[Span | tuple]") -> "Timeline":
        self.spans.extend(Span(*s) for s in (other.spans if isinstance(other, Timeline) else other))
        return self

    @property
    def lanes(self) -> list[str]:
        return list(dict.fromkeys(s.lane for s in self.spans))

    def makespan(self) -> float:
        """Time from the first start to the last end."""
        if not self.spans:
            return 0.0
        return max(s.end for s in self.spans) - min(s.start for s in self.spans)

    def busy(self, lane: str) -> float:
        """Total time spent in spans of one lane."""
        return sum(s.duration for s in self.spans if s.lane == lane)

    def overlap(self, lane_a: str, lane_b: str) -> float:
        """Time during which both lanes were busy (spans within a lane assumed disjoint)."""
        total = 0.0
        for a in (s for s in self.spans if s.lane == lane_a):
            for b in (s for s in self.spans if s.lane == lane_b):
                total += max(0.0, min(a.end, b.end) - max(a.start, b.start))
        return total

    def __len__(self) -> int:
        return len(self.spans)


QUIET_PER_CORE = 0.5     # one-minute load average per core under which a machine counts as quiet
ALLOW_LOAD = "D2LPAR_ALLOW_LOAD"


def load_line(why: str = "") -> str:
    """One line on how busy the machine is before a timed run ('' where the system cannot say).

    On a shared CPU, timings measure the waiting for cores as much as the code: print this first.
    It says so when the run was made busy on purpose (``D2LPAR_ALLOW_LOAD=1``, see ``quiet_or_exit``).
    """
    if not hasattr(os, "getloadavg"):
        return ""
    override = (f"; {ALLOW_LOAD}=1: not waited for quiet"
                if os.environ.get(ALLOW_LOAD) == "1" else "")
    return (f"load average before the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPU(s)"
            + (f" ({why})" if why else "") + override)


def quiet_or_exit() -> int:
    """``python -m d2lpar quiet``: exit 0 when the one-minute load average is at most
    0.5 per core (or the override is set), else 1 with one line saying what was seen and what to do."""
    if not hasattr(os, "getloadavg") or os.environ.get(ALLOW_LOAD) == "1":
        return 0
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= QUIET_PER_CORE * cores:
        return 0
    print(f"the machine is busy: one-minute load average {load:.2f} on {cores} CPU(s), above "
          f"{QUIET_PER_CORE * cores:.2f}; timings executed now would not be this code's. Stop what else "
          f"runs and wait a minute, or run again with {ALLOW_LOAD}=1 (the notebooks then say so).")
    return 1
