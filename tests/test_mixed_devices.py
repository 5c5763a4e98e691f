import pytest
import torch
from torch.nn import functional as F

import d2lpar.infra.mixed_devices as mixed
from d2lpar.infra.data import split_sizes
from d2lpar.infra.mixed_devices import data_parallel_step, throughput
from d2lpar.infra.models import mlp
from d2lpar.infra.workers import DeviceQueue


@pytest.fixture
def setup():
    gen = torch.Generator().manual_seed(0)
    X, y = torch.randn(64, 20, generator=gen), torch.randint(0, 5, (64,), generator=gen)
    net = mlp((20, 16, 5))
    whole = torch.autograd.grad(F.cross_entropy(net(X), y), list(net.parameters()))
    with DeviceQueue("fast") as a, DeviceQueue("slow") as b:
        yield [a, b], net, X, y, whole


def _close(grads, whole):
    return all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(grads, whole))


def test_an_uneven_split_sums_to_the_whole_batch_gradient(setup):
    queues, net, X, y, whole = setup
    grads, seconds = data_parallel_step(queues, net, X, y, [48, 16], [0.0, 0.0])
    assert _close(grads, whole) and seconds > 0


def test_the_gradient_check_fails_when_slices_are_scaled_by_one_over_n(setup, monkeypatch):
    queues, net, X, y, whole = setup
    monkeypatch.setattr(mixed, "_share", lambda part, batch, n: 1 / n)
    uneven, _ = data_parallel_step(queues, net, X, y, [48, 16], [0.0, 0.0])
    even, _ = data_parallel_step(queues, net, X, y, [32, 32], [0.0, 0.0])
    assert not _close(uneven, whole)   # the check on the uneven split catches it ...
    assert _close(even, whole)         # ... an even split alone would hide it


def test_throughput_orders_the_devices_and_the_split_follows_it(setup):
    queues, net, X, y, _ = setup
    per_example = [0.1e-3, 0.4e-3]
    speeds = [throughput(q, net, X[:32], y[:32], s) for q, s in zip(queues, per_example)]
    assert speeds[0] > 2 * speeds[1]
    sizes = split_sizes(len(X), weights=speeds)
    assert sizes[0] > sizes[1]
    for _ in range(3):   # a busy machine can delay one step; the split must win in one of three
        _, t_even = data_parallel_step(queues, net, X, y, [32, 32], per_example)
        _, t_split = data_parallel_step(queues, net, X, y, sizes, per_example)
        if t_split < t_even:
            break
    assert t_split < t_even


def test_bad_input_says_what_to_do(setup):
    queues, net, X, y, _ = setup
    with pytest.raises(ValueError, match="add up to the batch"):
        data_parallel_step(queues, net, X, y, [10, 10], [0.0, 0.0])
    with pytest.raises(ValueError, match="at least one example"):
        throughput(queues[0], net, X[:0], y[:0], 0.0)
