"""A Timed layer computes the same gradients, waits its device time in backward, and records spans;
the layers of one model share a device clock that hides the CPU's work when it fits."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from d2lpar.infra.device_time import DeviceClock, Timed, record, set_backward_time, timed_mlp
from d2lpar.infra.timing import Timeline


def test_same_gradients_a_wait_and_one_span_per_layer():
    model = timed_mlp(width=16, depth=2, seed=0)
    plain = nn.Sequential(*[copy.deepcopy(m.layer) for m in model])
    shares = set_backward_time(model, 0.06)
    assert shares[0] == shares[1] > shares[2] > 0 and sum(shares) == pytest.approx(0.06)
    tl = Timeline()
    record(model, tl, "rank 0 compute")
    x = torch.randn(4, 16)  # needs no gradient: the first layer is still timed
    t0 = time.perf_counter()
    model(x).square().sum().backward()
    assert time.perf_counter() - t0 >= 0.06
    plain(x).square().sum().backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert a.grad is not None and a.grad.abs().sum() > 0
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    assert [s.label for s in tl.spans] == ["backward output", "backward layer 1", "backward layer 0"]
    # One device: the k-th layer backward reaches ends no earlier than backward's start plus the
    # device time of the first k layers.
    start, due = tl.spans[0].start, 0.0
    for span, share in zip(tl.spans, shares[::-1]):
        due += share
        assert span.end - start >= due


class _SlowGrad(torch.autograd.Function):
    """Identity whose backward keeps the CPU busy for 20 ms (wall time), as real gradients do."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass
        return grad


class _Slow(nn.Module):
    def forward(self, x):
        return _SlowGrad.apply(x)


def test_cpu_work_hides_in_the_device_time_of_a_shared_clock_only(monkeypatch):
    asked: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds):  # records what each wait asks for (a loaded machine wakes late, not early)
        asked.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)

    def waits(shared: bool) -> list[float]:
        model = nn.Sequential(Timed(_Slow(), 0.05), Timed(_Slow(), 0.05))
        if shared:
            model[1].clock = model[0].clock
        x = torch.ones(3, requires_grad=True)
        asked.clear()
        model(x).sum().backward()
        return list(asked)

    # Own clocks: each layer waits its 50 ms, whatever the CPU did. One clock: the second wait is
    # shortened by at least the first layer's 20 ms of CPU work.
    own, shared = waits(False), waits(True)
    assert own == [pytest.approx(0.05, abs=1e-9)] * 2, own
    assert shared[0] == pytest.approx(0.05, abs=1e-9) and sum(shared) <= 0.08 + 1e-9, shared
    clock = DeviceClock()
    clock.run(0.0)
    real_sleep(0.03)
    asked.clear()
    clock.run(0.01)  # the device already finished this work while the CPU was away: no wait
    assert asked == []


def test_bad_input():
    with pytest.raises(ValueError, match="negative"):
        Timed(nn.Linear(2, 2), -1.0)
    with pytest.raises(ValueError, match="no Timed layers"):
        set_backward_time(nn.Linear(2, 2), 1.0)
    with torch.no_grad():  # no autograd, no timing: just the layer
        assert Timed(nn.Identity(), 5.0)(torch.ones(2)).sum() == 2
