"""Worked solutions to the exercises of notebook 01 (the ways to split a training step).

Each ``exercise_k`` computes its answer, prints it, and asserts what the answer claims.
"""

from __future__ import annotations

import torch
from torch import nn

from d2lpar.cost.memory import STRATEGIES, footprints, partition_layers
from d2lpar.cost.staleness import delayed_sgd, make_batches
from d2lpar.infra.activations import saved_activation_bytes
from d2lpar.infra.data import load_digits
from d2lpar.infra.models import count_parameters, lenet, mlp
from d2lpar.infra.workers import torch_threads

BIG, BATCH, N, MiB = (784, 2048, 2048, 2048, 10), 2048, 4, 2 ** 20


def exercise_1():
    """Adam keeps 2 numbers per parameter, SGD none: the saving is 8 bytes per parameter a device holds,
    so it is largest where a device holds the most parameters: one device and data parallelism."""
    change = {}
    for s in STRATEGIES:
        n = 1 if s == "single" else N
        adam, sgd = footprints(BIG, BATCH, n, s, "adam"), footprints(BIG, BATCH, n, s, "sgd")
        change[s] = max(a.total - b.total for a, b in zip(adam, sgd))
        print(f"{s:<15} largest per-device saving with SGD: {change[s] / MiB:6.1f} MiB")
    P = count_parameters(mlp(BIG, seed=None))
    assert change["data"] == change["single"] == 8 * P == max(change.values())
    assert all(change[s] < change["data"] for s in ("model", "channel", "pipeline-gpipe"))


def exercise_2():
    """Per layer of LeNet: max pooling keeps its input *and* the int64 indices of its maxima (8 bytes
    per output element), so it keeps more than its input; every other layer keeps at most its input."""
    net, x = lenet(), torch.randn(16, 1, 28, 28)
    extra_per_layer = {}
    for i, layer in enumerate(net):
        inp = x.detach().requires_grad_()
        kept = saved_activation_bytes(nn.Sequential(layer), inp)
        out = layer(inp)
        given = inp.numel() * inp.element_size()
        print(f"{i:>2} {type(layer).__name__:<10} input {given:>8,} B   kept {kept:>8,} B")
        if kept > given:
            extra_per_layer[i] = (layer, kept - given, out.numel())
        x = out
    assert all(isinstance(layer, nn.MaxPool2d) for layer, _, _ in extra_per_layer.values())
    assert len(extra_per_layer) == sum(isinstance(m, nn.MaxPool2d) for m in net) == 2
    assert all(extra == 8 * numel for _, extra, numel in extra_per_layer.values())
    print("so the formula gains 8 bytes per output element of every max pooling layer "
          "(its indices, int64), besides 4 bytes per element of each layer's input")


def exercise_3():
    """1F1B keeps at most n - g micro-batches on stage g, GPipe all m: 1F1B keeps fewer on a stage
    exactly when m > n - g, so on every stage once m > n (with n = 4 stages here)."""
    for m in (1, 2, 4, 5, 8):
        g_pipe = [f.activations for f in footprints(BIG, BATCH, N, "pipeline-gpipe", micro_batches=m)]
        one_f = [f.activations for f in footprints(BIG, BATCH, N, "pipeline-1f1b", micro_batches=m)]
        fewer = [b < a for a, b in zip(g_pipe, one_f)]
        print(f"m={m}: 1F1B keeps fewer activations on stages {[g for g, f in enumerate(fewer) if f]}")
        k = len(partition_layers(BIG, N))
        assert fewer == [m > k - g for g in range(k)]


def exercise_4():
    """With lr / tau the stale run is stable again, but slower per gradient than no delay."""
    train, test = load_digits()
    X, y = train.tensors
    batches = make_batches(X, y, 32, 600)
    base, lr, tau = mlp((784, 64, 10)), 0.1, 7
    with torch_threads(1):
        stale = delayed_sgd(base, batches, lr, tau, test.tensors, eval_every=100)[0][-1]
        smaller = delayed_sgd(base, batches, lr / tau, tau, test.tensors, eval_every=100)[0][-1]
        fresh = delayed_sgd(base, batches, lr, 0, test.tensors, eval_every=100)[0][-1]
    print(f"test loss after 600 gradients: tau={tau} at lr {stale:.3f}; tau={tau} at lr/tau {smaller:.3f}; "
          f"no delay at lr {fresh:.3f}")
    assert smaller < stale / 2, "lr / tau should make the stale run converge"
    assert smaller > fresh, "with a 7x smaller step it does not catch up in the same number of gradients"
