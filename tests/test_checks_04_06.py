"""The checks of notebooks 04-06 fail on a broken mechanism (and pass on the real one).

Each test runs a notebook's check, as the notebook runs it, once on the real mechanism and once on a
broken one: a parameter server whose pull does nothing, an all-reduce that averages instead of
summing (a gradient scaled wrong) or is skipped, a data-parallel step that divides each device's
loss by its own share instead of the global batch.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from d2lpar.comm import param_server as PS
from d2lpar.infra.check import CheckFailed, check_changed, check_close
from d2lpar.infra.data import split_batch
from d2lpar.infra.devices import get_devices
from d2lpar.infra.models import lenet
from d2lpar.processes.launch import launch
from d2lpar.strategies.data.data_parallel import DataParallelSGD, allreduce_grads, replicate

SHAPES = {"w": (3, 2), "b": (5,)}


def _grads_of(rank):
    g = torch.Generator().manual_seed(rank)
    return {key: torch.randn(shape, generator=g) for key, shape in SHAPES.items()}


def _push_pull(broken):
    grads = _grads_of(dist.get_rank())
    ps = PS.ParameterServer(2)
    ps.push(grads)
    if not broken:
        ps.pull(grads)
    return grads


def test_pulled_sums_check_fails_when_pull_does_nothing():
    """Notebook 04's key-value check: values differ before the push, equal the sums after."""
    n = 3
    inputs = [_grads_of(r) for r in range(n)]
    sums = {key: sum(g[key] for g in inputs) for key in SHAPES}
    check_changed("each rank's values differ from the sums before push", inputs, [sums] * n)
    for broken in (False, True):
        pulled = launch(_push_pull, n, broken, timeout=30)
        if broken:
            with pytest.raises(CheckFailed):
                check_close("every rank pulled the sums computed here", pulled, [sums] * n)
        else:
            check_close("every rank pulled the sums computed here", pulled, [sums] * n)


def _one_step_gradients(all_reduce):
    """Notebook 05's one step by hand on 3 simulated devices, with the given all-reduce."""
    torch.manual_seed(0)
    X, y = torch.rand(12, 1, 28, 28), torch.randint(0, 10, (12,))
    devices = get_devices(3)
    loss = nn.CrossEntropyLoss(reduction="sum")
    xs, ys = split_batch(X, y, devices)
    replicas = replicate(lenet(seed=0), devices)
    for r, xi, yi in zip(replicas, xs, ys):
        (loss(r(xi), yi) / len(X)).backward()
    partial = [[p.grad.clone() for p in r.parameters()] for r in replicas]
    all_reduce(replicas)
    single = lenet(seed=0)
    nn.functional.cross_entropy(single(X), y).backward()
    return partial, [[p.grad for p in r.parameters()] for r in replicas], \
        [p.grad for p in single.parameters()]


@torch.no_grad()
def _averaging_all_reduce(replicas):
    allreduce_grads(replicas)
    for r in replicas:
        for p in r.parameters():
            p.grad /= len(replicas)   # the mean where the loss was already divided by B: scaled wrong


@pytest.mark.parametrize("broken", [_averaging_all_reduce, lambda replicas: None],
                         ids=["averages", "skipped"])
def test_single_device_gradient_check_fails_on_a_wrong_all_reduce(broken):
    partial, reduced, expected = _one_step_gradients(allreduce_grads)
    for grads in partial:
        check_changed("before the all-reduce, a device's gradient is not the whole batch's",
                      grads, expected)
    check_close("every device holds the single-device gradient", reduced, [expected] * 3,
                rtol=1e-4, atol=1e-6)
    _, reduced, expected = _one_step_gradients(broken)
    with pytest.raises(CheckFailed):
        check_close("every device holds the single-device gradient", reduced, [expected] * 3,
                    rtol=1e-4, atol=1e-6)


class _OwnShareSGD(DataParallelSGD):
    """Each device's loss divided by its own share, then the sums averaged: wrong for uneven parts."""

    def step(self, X, y):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        xs, ys = split_batch(X, y, self.devices, sizes=self.sizes(len(X)))
        for net, xi, yi in zip(self.replicas, xs, ys):
            (self.loss(net(xi), yi) / len(xi)).backward()
        allreduce_grads(self.replicas)
        with torch.no_grad():
            for r in self.replicas:
                for p in r.parameters():
                    p.grad /= len(self.replicas)
        for opt in self.optimizers:
            opt.step()


def test_k_devices_equal_one_check_fails_when_losses_are_divided_by_the_own_share():
    """Notebook 05's proof, on a balanced split (device 0 takes fewer examples)."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.rand(20, 1, 28, 28, generator=g), torch.randint(0, 10, (20,), generator=g))
               for _ in range(2)]
    reference = lenet(seed=1)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for X, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(reference(X), y).backward()
        opt.step()
    check_changed("2 steps on one device moved every parameter", reference, lenet(seed=1))
    for cls in (DataParallelSGD, _OwnShareSGD):
        trainer = cls(lenet(seed=1), get_devices(3), lr=0.1, split="balanced", gpu0_bsz=4)
        for X, y in batches:
            trainer.step(X, y)
        if cls is DataParallelSGD:
            check_close("k=3 balanced == one device", trainer.net, reference, rtol=1e-4, atol=1e-5)
        else:
            with pytest.raises(CheckFailed):
                check_close("k=3 balanced == one device", trainer.net, reference,
                            rtol=1e-4, atol=1e-5)
