"""The bucketed all-reduce cost model: its schedule by hand, its best cap against a search."""

from __future__ import annotations

import pytest

from d2lpar.cost.buckets import (best_cap, bucket_schedule, fit_terms, ring_terms, uniform_best_cap,
                                 uniform_step)
from d2lpar.cost.costmodel import MACHINES, allreduce_time


def test_schedule_by_hand():
    # three layers of 10 ms and 100 bytes; T(K) = 1 ms + K * 0.1 ms/byte... in seconds
    layers = [(0.010, 100)] * 3
    run = bucket_schedule(layers, 100, lambda k: 0.001 + k * 1e-4)  # 11 ms per bucket
    assert [(b, r) for b, r, _, _ in run.buckets] == [(100, 0.010), (100, 0.020), (100, 0.030)]
    assert [round(e, 6) for *_, e in run.buckets] == [0.021, 0.032, 0.043]  # comm-bound: waits
    assert run.step == pytest.approx(0.043) and run.exposed == pytest.approx(0.013)
    one = bucket_schedule(layers, 10 ** 6, lambda k: 0.001 + k * 1e-4)
    assert len(one.buckets) == 1 and one.step == pytest.approx(0.030 + 0.031)


def test_best_caps_agree_with_a_search():
    for machine in MACHINES.values():
        a, b = ring_terms(machine, machine.devices)
        assert a + 1e6 * b == pytest.approx(allreduce_time("ring", 1e6, machine.devices, machine))
        for compute in (0.01, 0.05, 0.2):
            G = 100e6
            grid = [G / 2 ** (k / 8) for k in range(0, 160)]
            searched = min(grid, key=lambda c: uniform_step(c, compute, G, a, b))
            best = uniform_best_cap(compute, G, a, b)
            assert uniform_step(best, compute, G, a, b) <= \
                uniform_step(searched, compute, G, a, b) * 1.001
            layers = [(compute / 50, int(G / 50))] * 50
            cap, run = best_cap(layers, lambda k: a + k * b)
            assert run.step <= bucket_schedule(layers, int(G), lambda k: a + k * b).step


def test_fit_terms():
    sizes = [1e3, 1e5, 1e6, 4e6]
    a, b = fit_terms(sizes, [2e-4 + s * 1e-9 for s in sizes])
    assert a == pytest.approx(2e-4) and b == pytest.approx(1e-9)
    with pytest.raises(ValueError, match="larger"):
        fit_terms([1, 2], [1.0, 0.5])
