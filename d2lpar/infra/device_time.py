"""Layers whose backward takes device time: a calibrated wait that leaves the CPU free, as a GPU does.

On a GPU, a layer's backward is a few kernels queued by the CPU and run by the GPU: while they run,
the CPU thread (and the network, and the communication library's own thread) is free. That is what
lets an all-reduce overlap backward. Simulated ranks on a small CPU cannot show it: two ranks and
gloo's threads share two cores, so a real CPU backward takes the core that the all-reduce needs.

``Timed(layer, seconds)`` keeps everything real (the forward, the gradients, every message) and
adds, at the start of the layer's backward, a wait (``time.sleep``: the CPU is free, as while a GPU
computes). Choose ``seconds`` from a measurement, e.g. proportional to the layer's FLOPs and scaled
to the measured all-reduce time. With a ``Timeline``, each layer's backward (wait plus real
gradient) is recorded as a span ``(lane, 'backward <name>', start, end)``:

    out = Mark(after)( layer( Mark(before)(x) ) )   backward: wait, layer's gradients, end of span

The waits follow a ``DeviceClock`` shared by the layers of one model (``set_backward_time`` sets
one up), as kernels queued on one GPU run back to back: the device starts when backward starts, and
the backward of the k-th layer it reaches ends no earlier than that start plus the device time of
the first k layers. Work the CPU does meanwhile (the real gradients, hooks, copies) is hidden in that
time as long as it fits, as a CPU's work hides behind a GPU's queue; a late wake-up of one layer
does not push the later ones back. A layer with its own clock (the default) just waits ``seconds``.

``Busy(layer, flops, rate)`` stands in for a whole device, forward and backward: after the layer's
real forward it waits ``flops(x) / rate`` (its forward FLOPs at the simulated device's rate), and at
the start of its backward twice that (a backward computes two products for each forward one). The
layer's own messages (a tensor-parallel all-reduce) still run for real, after or before the wait,
as they follow the computation on a device that does not overlap them.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from d2lpar.infra.timing import Timeline

__all__ = ["DeviceClock", "Timed", "timed_mlp", "set_backward_time", "record", "Busy"]


class DeviceClock:
    """The time at which a simulated device finishes the work queued on it so far.

    ``run(seconds)`` queues ``seconds`` of device work and sleeps until the device is done with it.
    The first call after ``reset()`` starts the device at the current time; later calls queue behind
    the earlier ones (a GPU runs its queue without gaps while the CPU keeps ahead of it).
    """

    def __init__(self):
        self.due: float | None = None

    def reset(self) -> None:
        self.due = None

    def run(self, seconds: float) -> None:
        now = time.perf_counter()
        self.due = (now if self.due is None else self.due) + seconds
        if self.due > now:
            time.sleep(self.due - now)


class _Start(torch.autograd.Function):
    """Identity; its backward runs first among the layer's (it sees the output's gradient)."""

    @staticmethod
    def forward(ctx, y, owner):
        ctx.owner = owner
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ctx.owner._t0 = time.perf_counter()
        ctx.owner.clock.run(ctx.owner.seconds)
        return grad, None


class _End(torch.autograd.Function):
    """Identity on the layer's input; its backward runs once the layer's gradients are done."""

    @staticmethod
    def forward(ctx, x, anchor, owner):
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        o = ctx.owner
        if o.timeline is not None and o._t0 is not None:
            o.timeline.add(o.lane, f"backward {o.name}", o._t0, time.perf_counter())
        o._t0 = None
        return (grad if ctx.needs_input_grad[0] else None), None, None


class Timed(nn.Module):
    """``layer`` whose backward starts with a wait of ``seconds`` and is recorded on ``timeline``."""

    def __init__(self, layer: nn.Module, seconds: float = 0.0, name: str = "layer"):
        super().__init__()
        if seconds < 0:
            raise ValueError(f"seconds={seconds}: a wait cannot be negative")
        self.layer, self.seconds, self.name = layer, seconds, name
        self.timeline: Timeline | None = None
        self.lane, self._t0, self.clock = "compute", None, DeviceClock()
        # A leaf that needs a gradient, so that _End's backward runs even for the first layer,
        # whose input needs none. It is not a parameter: nothing optimizes or sends it.
        self._anchor = torch.zeros((), requires_grad=True)

    def forward(self, x):
        if not torch.is_grad_enabled():
            return self.layer(x)
        self.clock.reset()  # the next backward starts the device afresh
        return _Start.apply(self.layer(_End.apply(x, self._anchor, self)), self)


def timed_mlp(width: int = 512, depth: int = 8, classes: int = 10, seed: int = 0) -> nn.Sequential:
    """``depth`` hidden ``Linear(width, width)`` + ReLU blocks and an output layer, each ``Timed``."""
    torch.manual_seed(seed)
    layers = [Timed(nn.Sequential(nn.Linear(width, width), nn.ReLU()), name=f"layer {i}")
              for i in range(depth)]
    return nn.Sequential(*layers, Timed(nn.Linear(width, classes), name="output"))


def set_backward_time(model: nn.Module, total_s: float) -> list[float]:
    """Share ``total_s`` seconds of backward among the model's ``Timed`` layers in proportion to
    their parameters (a Linear layer's FLOPs are proportional to its weights), on one
    ``DeviceClock`` (one device runs them one after another); return the shares."""
    timed = [m for m in model.modules() if isinstance(m, Timed)]
    if not timed:
        raise ValueError("the model has no Timed layers: wrap its layers in Timed(...) first")
    sizes = [sum(p.numel() for p in m.parameters()) for m in timed]
    clock = DeviceClock()
    for m, s in zip(timed, sizes):
        m.seconds, m.clock = total_s * s / sum(sizes), clock
    return [m.seconds for m in timed]


def record(model: nn.Module, timeline: Timeline | None, lane: str = "compute") -> None:
    """Record the backward of every ``Timed`` layer of ``model`` on ``timeline`` (None: stop)."""
    for m in model.modules():
        if isinstance(m, Timed):
            m.timeline, m.lane = timeline, lane


class _WaitInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, seconds):
        ctx.seconds = seconds
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Busy(nn.Module):
    """``layer`` computed on a simulated device of ``rate`` FLOP/s (``flops(x)``: its forward FLOPs)."""

    def __init__(self, layer: nn.Module, flops, rate: float):
        super().__init__()
        if not rate > 0:
            raise ValueError(f"rate={rate!r}: give the simulated device's FLOP/s, a positive number")
        self.layer, self.flops, self.rate = layer, flops, rate

    def forward(self, x):
        seconds = self.flops(x) / self.rate
        y = self.layer(x)
        time.sleep(seconds)
        if torch.is_grad_enabled() and y.requires_grad:
            y = _WaitInBackward.apply(y, 2 * seconds)
        return y
