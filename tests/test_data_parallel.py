"""Data parallelism by hand equals single-device training on the same global batch."""

import pytest
import torch
from torch import nn

from d2lpar.strategies.data import data_parallel as dp
from d2lpar.infra.check import check_changed, check_close
from d2lpar.infra.devices import get_devices
from d2lpar.infra.models import lenet, mlp


def _batches(steps=3, B=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(B, 1, 28, 28, generator=g), torch.randint(0, 10, (B,), generator=g))
            for _ in range(steps)]


def _single_device(net, batches, lr, momentum=0.0):
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    for X, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
    return net


@pytest.mark.parametrize("k, kwargs", [
    (1, {}), (2, {}), (3, {}), (4, {}),
    (3, {"split": "balanced", "gpu0_bsz": 2}),
    (3, {"split": "balanced", "gpu0_bsz": 2, "accumulation": 2}),
    (2, {"split": "proportional", "weights": [3.0, 1.0]}),
    (4, {"momentum": 0.9, "accumulation": 3}),
])
def test_k_devices_equal_one_device(k, kwargs):
    batches = _batches()
    momentum = kwargs.get("momentum", 0.0)
    expected = _single_device(lenet(seed=1), batches, lr=0.5, momentum=momentum)
    trainer = dp.DataParallelSGD(lenet(seed=1), get_devices(k), lr=0.5, **kwargs)
    for X, y in batches:
        trainer.step(X, y)
    assert trainer.in_sync()
    check_changed("training moved every parameter", trainer.net, lenet(seed=1), rtol=1e-4, atol=1e-5)
    check_close(f"{k} devices {kwargs} == one device", trainer.net, expected, rtol=1e-4, atol=1e-5)


def test_step_returns_the_mean_loss_and_counts_bytes():
    X, y = _batches(1)[0]
    net = mlp((784, 16, 10), seed=0)
    expected = nn.functional.cross_entropy(net(X), y).item()
    trainer = dp.DataParallelSGD(net, get_devices(3), lr=0.1)
    assert trainer.step(X, y) == pytest.approx(expected, rel=1e-5)
    K = sum(p.numel() * 4 for p in net.parameters())
    assert trainer.bytes_reduced == 2 * (3 - 1) * K


def test_splits_and_errors():
    assert dp.balanced_sizes(8, 3, 2) == [2, 3, 3]
    assert dp.balanced_sizes(16 // 2, 3, 4 // 2) == [2, 3, 3]  # the seeds' batch 16, acc_grad 2
    assert dp.balanced_sizes(10, 1, 3) == [10]
    with pytest.raises(ValueError, match="gpu0_bsz"):
        dp.balanced_sizes(4, 3, 3)
    assert dp.micro_batch_sizes(10, 3) == [4, 3, 3]
    with pytest.raises(ValueError, match="accumulation"):
        dp.micro_batch_sizes(10, 0)
    devs = get_devices(2)
    assert torch.equal(dp.gather([torch.arange(2), None, torch.arange(2, 5)], devs[0]), torch.arange(5))
    with pytest.raises(ValueError, match="gpu0_bsz"):
        dp.DataParallelSGD(mlp((4, 2)), devs, 0.1, split="balanced")
    with pytest.raises(ValueError, match="weight"):
        dp.DataParallelSGD(mlp((4, 2)), devs, 0.1, split="proportional", weights=[1.0])
    with pytest.raises(ValueError, match="split"):
        dp.DataParallelSGD(mlp((4, 2)), devs, 0.1, split="random")


def test_replicas_are_independent_and_evaluate_counts():
    net = mlp((4, 3), seed=0)
    reps = dp.replicate(net, get_devices(2))
    with torch.no_grad():
        reps[1][1].weight.add_(1.0)
    assert not torch.equal(reps[0][1].weight, reps[1][1].weight)
    X = torch.randn(10, 4)
    y = net(X).argmax(1)
    assert dp.evaluate(net, [(X, y)]) == 1.0
