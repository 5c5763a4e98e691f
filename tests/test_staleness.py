import math

import pytest
import torch

from d2lpar.infra.check import check_changed, check_close
from d2lpar.infra.models import mlp
from d2lpar.cost.staleness import (delayed_quadratic, delayed_sgd, make_batches, stability_bound,
                                   sync_sgd)


def _data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_stability_bound_known_values():
    assert stability_bound(0) == pytest.approx(2.0)
    assert stability_bound(1) == pytest.approx(1.0)
    assert stability_bound(10) < stability_bound(3) < stability_bound(1)


@pytest.mark.parametrize("tau", [0, 1, 4])
def test_delayed_quadratic_converges_below_the_bound_and_not_above(tau):
    a = stability_bound(tau)
    assert abs(delayed_quadratic(0.9 * a, tau, 2000)[-1]) < 1e-3
    assert abs(delayed_quadratic(1.1 * a, tau, 2000)[-1]) > 1.0


def test_no_delay_is_plain_sgd():
    X, y = _data()
    model = mlp((16, 8, 3))
    batches = make_batches(X, y, 16, 12)
    _, trained = delayed_sgd(model, batches, 0.1, 0, (X, y))
    ref = mlp((16, 8, 3))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for xb, yb in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(xb), yb).backward()
        opt.step()
    check_changed("12 steps moved every parameter", ref, mlp((16, 8, 3)))
    check_close("delay 0 equals torch.optim.SGD", trained, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("workers", [1, 3, 4])
def test_sync_sgd_equals_big_batch_sgd(workers):
    X, y = _data()
    model = mlp((16, 8, 3))
    batches = make_batches(X, y, 30, 5)
    par = sync_sgd(model, batches, 0.2, workers)
    _, seq = delayed_sgd(model, batches, 0.2, 0, (X, y))
    check_changed("5 steps moved every parameter", seq, model)
    check_close(f"sync SGD on {workers} workers equals one-device SGD", par, seq,
                rtol=1e-5, atol=1e-6)


def test_stale_gradients_hurt_and_divergence_is_reported():
    X, y = _data()
    model = mlp((16, 8, 3))
    batches = make_batches(X, y, 16, 60)
    fresh, _ = delayed_sgd(model, batches, 0.5, 0, (X, y))
    stale, _ = delayed_sgd(model, batches, 0.5, 8, (X, y))
    assert fresh[-1] < stale[-1]
    blown, _ = delayed_sgd(model, batches, 50.0, 8, (X, y), diverged=10.0)
    assert blown[-1] == math.inf
    with pytest.raises(ValueError, match="tau"):
        delayed_sgd(model, batches, 0.1, -1, (X, y))


def test_make_batches_is_reproducible():
    X, y = _data()
    a, b = make_batches(X, y, 10, 20, seed=3), make_batches(X, y, 10, 20, seed=3)
    assert len(a) == 20 and all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
