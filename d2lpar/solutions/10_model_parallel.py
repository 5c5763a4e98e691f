"""Worked solutions for notebooks/10_model_parallel.ipynb (pure Python and one process: seconds)."""

import torch
from torch import nn

from d2lpar.cost import bubble
from d2lpar.infra.activations import SavedTensors
from d2lpar.strategies.pipeline import schedules as P
from d2lpar.strategies.pipeline.simulator import simulate


def exercise_1():
    """Uneven cut: stage 0 does twice the work of each other stage (same total work as the even cut)."""
    even = simulate(P.naive(4), stage_scale=[1.0] * 4)
    uneven = simulate(P.naive(4), stage_scale=[8 / 5, 4 / 5, 4 / 5, 4 / 5])   # 2x : 1x : 1x : 1x, sum 4
    print("idle per rank, even cut:  ", [round(i, 3) for i in even.idle])
    print("idle per rank, uneven cut:", [round(i, 3) for i in uneven.idle])
    print(f"step time: even {even.makespan:.3f}, uneven {uneven.makespan:.3f} (units of one even forward)")
    assert min(uneven.idle) == uneven.idle[0]            # the heavy stage waits least
    assert abs(uneven.makespan - even.makespan) < 1e-9   # one device works at a time: the sum is the same
    # With one micro-batch the cut changes who waits, not how long the step takes; with micro-batches
    # (notebook 11) the slowest stage sets the pace and an uneven cut costs time.
    gp_even = simulate(P.gpipe(4, 8), stage_scale=[1.0] * 4).makespan
    gp_uneven = simulate(P.gpipe(4, 8), stage_scale=[8 / 5, 4 / 5, 4 / 5, 4 / 5]).makespan
    print(f"GPipe, m=8: even {gp_even:.2f}, uneven {gp_uneven:.2f}")
    assert gp_uneven > gp_even


def exercise_2():
    """Micro-batches fill the pipeline: GPipe's idle fraction falls as (p-1)/(m+p-1)."""
    for m in (1, 2, 4, 8):
        sim = simulate(P.gpipe(4, m))
        formula = bubble.idle_fraction("GPipe", 4, m)
        print(f"m={m}: simulated idle {sim.bubble:.3f}, formula (p-1)/(m+p-1) = {formula:.3f}")
        assert abs(sim.bubble - formula) < 1e-12


def _model(width=128, depth=8):
    torch.manual_seed(0)
    layers = [nn.Flatten(), nn.Linear(784, width)]
    for _ in range(depth - 2):
        layers += [nn.ReLU(), nn.Linear(width, width)]
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(width, 10))


def exercise_3():
    """Cut after a ReLU: the boundary activation is saved on both sides."""
    model = _model()
    X, y = torch.rand(64, 1, 28, 28), torch.arange(64) % 10
    with SavedTensors(model) as whole:
        loss = nn.functional.cross_entropy(model(X), y)   # kept: its graph holds the saved tensors
    first, second = model[:9], model[9:]                 # model[8] is a ReLU: the cut is after it
    assert isinstance(first[-1], nn.ReLU)
    with SavedTensors(model) as a:
        h = first(X)
    x = h.detach().requires_grad_()                      # what the second rank receives
    with SavedTensors(model) as b:
        loss2 = nn.functional.cross_entropy(second(x), y)
    boundary = h.numel() * h.element_size()
    print(f"one device {whole.current} B; stages {a.current} + {b.current} = {a.current + b.current} B; "
          f"one boundary activation {boundary} B")
    assert a.current + b.current == whole.current + boundary
    del loss, loss2


def exercise_4():
    """How many 1024-wide layers fit 24 MiB, with SGD and with Adam; ranks for the 8-layer model with Adam."""
    budget, mib = 24 * 2**20, 2**20
    layer = (1024 * 1024 + 1024) * 4
    sgd, adam = budget // (2 * layer), budget // (4 * layer)
    print(f"one 1024x1024 layer: {layer / mib:.2f} MiB of parameters; fit in 24 MiB: {sgd} with SGD "
          f"(parameters + gradients), {adam} with Adam (+ two moments)")
    assert (sgd, adam) == (2, 1)
    sizes = [4 * sum(p.numel() * p.element_size() for p in m.parameters())
             for m in _model(width=1024) if isinstance(m, nn.Linear)]
    ranks, load = 1, 0
    for s in sizes:                                      # greedy: the fewest consecutive groups
        if load + s > budget:
            ranks, load = ranks + 1, 0
        load += s
    print("per layer with Adam (MiB):", [round(s / mib, 1) for s in sizes], f"-> {ranks} ranks")
    assert ranks == 7
