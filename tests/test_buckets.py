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


def test_torch_default_first_bucket_is_1_mib():
    import torch.distributed as dist
    from torch.nn.parallel.distributed import _BucketCapacityConfig

    from d2lpar.cost.buckets import TORCH_FIRST_BUCKET
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == TORCH_FIRST_BUCKET == 2 ** 20
    default = _BucketCapacityConfig.create(None, None, False)
    given = _BucketCapacityConfig.create(25, None, False)
    assert (default.first_bucket_bytes_cap, default.bucket_bytes_cap) == (2 ** 20, 25 * 2 ** 20)
    assert given.first_bucket_bytes_cap == given.bucket_bytes_cap == 25 * 2 ** 20
    layers = [(0.001, 2 ** 19)] * 8  # 4 MiB in 512 KiB layers: first bucket 1 MiB, then the rest
    run = bucket_schedule(layers, 25 * 2 ** 20, lambda k: 1e-4, first_cap=TORCH_FIRST_BUCKET)
    assert [b for b, *_ in run.buckets] == [2 ** 20, 3 * 2 ** 20]


def test_against_measured_says_when_the_model_misses():
    from d2lpar.cost.buckets import against_measured
    layers = [(0.010, 100)] * 3
    T = lambda k: 0.001 + k * 1e-4  # noqa: E731
    rows = [{"cap_mb": c / 2 ** 20, "buckets": n,
             "step": bucket_schedule(layers, c, T).step} for c, n in ((100, 3), (10 ** 6, 1))]
    table, verdict = against_measured(rows, layers, 0.001, 1e-4)
    assert len(table) == 3 and verdict[0].startswith("the model predicts every cap within 15%")
    rows[1]["step"] *= 2  # the one-bucket step measured twice the model
    _, verdict = against_measured(rows, layers, 0.001, 1e-4)
    assert verdict[0].startswith("the model and the measurement disagree")
    rows[0]["step"] *= 4  # now the model's best cap measured slowest
    _, verdict = against_measured(rows, layers, 0.001, 1e-4)
    assert "picks the wrong cap" in verdict[1]
