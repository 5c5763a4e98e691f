"""Devices of unequal speed on one batch: split it in proportion to each one's measured throughput.

Hadjis et al. (2016, "Omnivore") train on the CPU and the GPUs of a machine together. In a
synchronous data-parallel step every device works on its slice b_i of the batch B, and the step
ends when the slowest one is done:

    t_step = max_i b_i / s_i         (s_i: examples per second of device i)

An even split b_i = B / n is paced by the slowest device. The split b_i = B s_i / sum(s) makes
every device finish together, at t_step = B / sum(s), the most the devices can do. The speeds are
measured (a timed slice on each device), not assumed; on simulated devices the measurement reads
back the waits they were configured with (plus the small real compute). Each slice's loss is
scaled by its share b_i / B, so the summed gradient is the whole batch's whatever the split: with
uneven slices, scaling by 1/n instead would be wrong (with even ones the two agree, which hides the
mistake).

A *simulated* device here is a ``DeviceQueue`` whose job computes the slice's gradient for real and
then waits ``seconds_per_example * b_i`` (its device time, with the CPU free), so devices of any
speed can be set up on a small CPU.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from d2lpar.infra.workers import DeviceQueue

__all__ = ["slice_gradient", "throughput", "data_parallel_step"]


def slice_gradient(model: nn.Module, X: torch.Tensor, y: torch.Tensor, share: float,
                   device_s: float = 0.0) -> list[torch.Tensor]:
    """The gradient of ``share`` x the mean loss on (X, y), then ``device_s`` of device time."""
    loss = F.cross_entropy(model(X), y) * share
    grads = torch.autograd.grad(loss, list(model.parameters()))  # leaves .grad alone: thread-safe
    time.sleep(device_s)
    return list(grads)


def _share(part: int, batch: int, n: int) -> float:
    return part / batch  # the slice's share of the batch (not 1/n: slices may differ in size)


def throughput(queue: DeviceQueue, model: nn.Module, X: torch.Tensor, y: torch.Tensor,
               seconds_per_example: float, repeats: int = 2) -> float:
    """Examples per second of ``queue`` on a slice (X, y): the best of ``repeats`` timed slices."""
    if repeats < 1 or len(X) == 0:
        raise ValueError("throughput needs repeats >= 1 and a slice of at least one example")
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        queue.submit(slice_gradient, model, X, y, 1.0, seconds_per_example * len(X),
                     label="measure").result()
        best = min(best, time.perf_counter() - t0)
    return len(X) / best


def data_parallel_step(queues: Sequence[DeviceQueue], model: nn.Module, X: torch.Tensor,
                       y: torch.Tensor, sizes: Sequence[int],
                       seconds_per_example: Sequence[float]) -> tuple[list[torch.Tensor], float]:
    """One synchronous step: slice i of ``sizes[i]`` examples on ``queues[i]``; the summed gradient
    and the step's time (until the last device is done)."""
    if sum(sizes) != len(X) or len(sizes) != len(queues) != len(seconds_per_example):
        raise ValueError(f"sizes {list(sizes)} must add up to the batch ({len(X)}), one per device")
    t0 = time.perf_counter()
    futures = [q.submit(slice_gradient, model, Xi, yi, _share(len(Xi), len(X), len(queues)),
                        spe * len(Xi), label=f"{len(Xi)} examples")
               for q, Xi, yi, spe in zip(queues, X.split(list(sizes)), y.split(list(sizes)),
                                         seconds_per_example)]
    parts = [f.result() for f in futures]
    seconds = time.perf_counter() - t0
    return [sum(gs) for gs in zip(*parts)], seconds
