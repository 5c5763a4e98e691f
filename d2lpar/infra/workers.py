"""A worker device: a thread with one torch thread and a queue, the course's model of a device.

A GPU is a queue. ``y = x @ x`` on ``cuda:0`` puts a kernel in the device's queue (its stream) and
returns at once; the GPU works through the queue while Python goes on, and ``synchronize`` waits until
the queue is empty. Two GPUs have two queues, so work given to both runs at the same time with no
extra code: t(both) ~ max(t_0, t_1) instead of t_0 + t_1.

On the CPU, PyTorch's operators are synchronous: each one has finished when it returns to the
calling thread. On a CPU-only machine ``DeviceQueue`` plays the GPU's part (a Python thread fed by a
``queue.Queue``; the queue is the course's, not PyTorch's). Each queue owns one worker thread that
runs one torch thread (``torch.set_num_threads(1)``), so k queues on a machine with k cores are k
devices that compute at the same time for real (PyTorch releases Python's GIL inside its operators).
``submit(fn, *args)`` returns a ``Future`` at once, like a kernel launch; ``synchronize()`` waits for
the queue to drain, like ``torch.cuda.synchronize(device)``; every job is recorded as a span on a
``Timeline`` lane named after the queue.

``training_loop`` shows what reading a result back costs. ``loss.item()`` on a GPU is a
synchronize: the host waits until the device has finished the step, so the host's own work for the
next step (Python, indexing, launching) cannot run while the device computes, and a step costs
t_host + t_device instead of max(t_host, t_device). Adding the losses up on the device and reading
the sum once at the end keeps the two busy at the same time.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from d2lpar.infra.timing import Timeline

__all__ = ["torch_threads", "DeviceQueue", "cores", "LoopRun", "training_loop"]


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(n)`` in this thread, then restore the old value."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


_STOP = object()


class DeviceQueue:
    """A worker device: a thread with one torch thread, fed through a queue (a model of a stream).

    The jobs it runs are real compute, or a calibrated wait standing in for device compute (the
    course calls a device whose jobs are such waits a *simulated* device).

    ``core`` pins the worker to one CPU core where the OS allows it (Linux); ``timeline`` (shared by
    several queues) receives one span per job, labelled with ``label`` or the function's name.
    Grad mode is thread-local in PyTorch (``torch.no_grad()`` holds only for the thread that
    entered it), so ``submit`` records the caller's mode and the worker runs the job under it.
    Use as a context manager, or call ``close()``.
    """

    def __init__(self, name: str, core: int | None = None, timeline: Timeline | None = None,
                 timeout: float = 120.0):
        self.name, self.core, self.timeout = name, core, timeout
        self.timeline = timeline if timeline is not None else Timeline()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"DeviceQueue-{name}", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        torch.set_num_threads(1)
        if self.core is not None and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, {self.core})  # on Linux 0 is the calling thread
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            future, fn, args, kwargs, label, grad = item
            if not future.set_running_or_notify_cancel():
                continue
            start = time.perf_counter()
            try:
                with torch.set_grad_enabled(grad):  # the caller's grad mode, not this thread's
                    result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)
            if label is not None:
                self.timeline.add(self.name, label, start, time.perf_counter())

    def submit(self, fn: Callable[..., Any], *args: Any, label: str | None = None,
               **kwargs: Any) -> Future:
        """Queue ``fn(*args, **kwargs)`` and return at once with a Future of its result."""
        if not self._thread.is_alive():
            raise RuntimeError(f"DeviceQueue {self.name!r} is closed: make a new one")
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs, label or getattr(fn, "__name__", "job"),
                        torch.is_grad_enabled()))
        return future

    def synchronize(self) -> None:
        """Wait until every job queued so far has finished (errors surface in their futures)."""
        done = threading.Event()
        self._jobs.put((Future(), done.set, (), {}, None, False))  # label None: not drawn
        if not done.wait(self.timeout):
            raise TimeoutError(f"DeviceQueue {self.name!r} did not drain within {self.timeout} s: "
                               "a job is stuck or too long; raise timeout= or make the job smaller")

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join(self.timeout)

    def __enter__(self) -> "DeviceQueue":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class LoopRun:
    """What ``training_loop`` measured: the summed loss, the reads that had to wait, the time."""
    total: float
    waits: int
    seconds: float


def _accumulate(acc: Future | None, loss: Future):
    # runs on the device after both jobs (one queue runs its jobs in order), so neither result waits
    return loss.result() if acc is None else acc.result() + loss.result()


def training_loop(device: DeviceQueue, batches: Iterable, step: Callable[[Any], torch.Tensor],
                  host_s: float, read_each_step: bool,
                  timeline: Timeline | None = None) -> LoopRun:
    """Run ``step(batch)`` on ``device`` for each batch, after ``host_s`` seconds of host work.

    ``read_each_step=True`` reads every loss back at once (``loss.item()``); otherwise the losses
    are added up on the device and the sum is read once, at the end. ``waits`` counts the reads that
    found the device still busy: each is a synchronize, a moment the host sat idle.
    """
    waits = 0

    def read(future: Future) -> float:
        nonlocal waits
        waits += not future.done()
        return float(future.result())

    t0 = time.perf_counter()
    total, acc = 0.0, None
    for batch in batches:
        start = time.perf_counter()
        time.sleep(host_s)  # the host's share of a step: Python, the next indices, the launches
        if timeline is not None:
            timeline.add("host", "host work", start, time.perf_counter())
        loss = device.submit(step, batch, label="step")
        if read_each_step:
            total += read(loss)  # loss.item(): wait for the device, then go on
        else:
            acc = device.submit(_accumulate, acc, loss, label="add")
    if acc is not None:
        total = read(acc)
    return LoopRun(total, waits, time.perf_counter() - t0)
