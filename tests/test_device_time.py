"""A Timed layer computes the same gradients, waits its seconds in backward, and records spans."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from d2lpar.infra.device_time import Timed, record, set_backward_time, timed_mlp
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
    assert all(s.duration >= share for s, share in zip(tl.spans, shares[::-1]))


def test_bad_input():
    with pytest.raises(ValueError, match="negative"):
        Timed(nn.Linear(2, 2), -1.0)
    with pytest.raises(ValueError, match="no Timed layers"):
        set_backward_time(nn.Linear(2, 2), 1.0)
    with torch.no_grad():  # no autograd, no timing: just the layer
        assert Timed(nn.Identity(), 5.0)(torch.ones(2)).sum() == 2
