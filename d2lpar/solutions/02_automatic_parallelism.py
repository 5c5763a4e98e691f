"""Worked solutions to the exercises of notebook 02 (automatic parallelism).

Each ``exercise_k`` computes its answer, prints it, and asserts what the answer claims.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch
from torch import nn

from d2lpar.cost.autopar import Graph, data_parallel_graph, forward_graph, independent_parts, list_schedule
from d2lpar.infra.models import mlp
from d2lpar.infra.verdict import busy_clause
from d2lpar.infra.workers import DeviceQueue, cores, torch_threads


def run(x, steps=20):
    return [x @ x for _ in range(steps)]


def _best(fn, repeats=5):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
    return min(times)


def exercise_1():
    """Two torch threads per worker device: each job alone may use both cores, so two jobs at once
    have no free core left, and both together can never beat one alone."""
    gen = torch.Generator().manual_seed(0)
    x0, x1 = torch.rand(384, 384, generator=gen), torch.rand(384, 384, generator=gen)

    def two_threads(x):
        torch.set_num_threads(2)  # inside the worker thread: this job may now use 2 cores
        return run(x), torch.get_num_threads()

    ratios = {}
    for threads, job in ((1, lambda x: (run(x), torch.get_num_threads())), (2, two_threads)):
        with DeviceQueue("cpu:0", core=None) as d0, DeviceQueue("cpu:1", core=None) as d1:
            alone = lambda d, x: (d.submit(job, x), d.synchronize())  # noqa: E731
            out = []
            both = lambda: out.append((d0.submit(job, x0), d1.submit(job, x1), d0.synchronize(),  # noqa: E731
                                       d1.synchronize()))
            both()  # warm up
            t_alone = max(_best(lambda: alone(d0, x0)), _best(lambda: alone(d1, x1)))
            t_both = _best(both)
            f0, f1 = out[-1][:2]
        with torch_threads(1):  # two threads may sum in another order: equal up to rounding
            assert all(torch.allclose(a, b) for a, b in zip(f0.result()[0], run(x0)))
            assert all(torch.allclose(a, b) for a, b in zip(f1.result()[0], run(x1)))
        assert f0.result()[1] == f1.result()[1] == threads
        ratios[threads] = t_both / t_alone
        print(f"{threads} torch thread(s) per device on {cores()} core(s): alone {t_alone * 1e3:.1f} ms, "
              f"both {t_both * 1e3:.1f} ms, both / max(alone) = {ratios[threads]:.2f}")
    print("with 2 threads each job alone already spreads over the cores: the pair takes turns,\n"
          "and the ratio moves from about 1 towards 2 (on an idle 2-core machine)")
    busy = busy_clause()
    if busy:  # other programs took cores while the jobs ran alone: the times say nothing here
        print("no conclusion from this run:" + busy)
        return
    assert ratios[2] > 0.9, "two jobs on all the cores cannot beat one (10% left for timing noise)"


class TwoTower(nn.Module):
    def __init__(self, width=1024, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.left = nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.right = nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.head = nn.Linear(2 * width, 10)

    def forward(self, x):
        return self.head(torch.cat([self.left(x), self.right(x)], dim=1))


def _graph():
    model, xb = TwoTower(), torch.rand(256, 784, generator=torch.Generator().manual_seed(1))
    return forward_graph(model, xb)


def exercise_2():
    """With a 1 MB/s link, moving the input (and the branch's output) to the second device costs far
    more than computing the branch where the data is: the scheduler keeps everything on one device."""
    graph = _graph()
    fast, where_fast = list_schedule(graph, ["dev0", "dev1"], speed=1e12, bandwidth=16e9)
    slow, where_slow = list_schedule(graph, ["dev0", "dev1"], speed=1e12, bandwidth=1e6)
    right = independent_parts(graph)[1]
    print(f"16 GB/s link: right branch on {sorted({where_fast[n] for n in right})}, makespan "
          f"{fast.makespan() * 1e6:.0f} us")
    print(f"1 MB/s link:  right branch on {sorted({where_slow[n] for n in right})}, makespan "
          f"{slow.makespan() * 1e6:.0f} us; devices used: {sorted(set(where_slow.values()))}")
    assert len(set(where_fast.values())) == 2 and set(where_slow.values()) == {"dev0"}
    one, _ = list_schedule(graph, ["dev0"], speed=1e12, bandwidth=1e6)
    assert abs(slow.makespan() - one.makespan()) < 1e-12  # the same as having one device


def exercise_3():
    """dev0 twice as fast: no gain over dev0 alone. A branch is a chain, so the best split gives each
    device whole branches; the slow device needs as long for one branch as the fast one for both."""
    graph = _graph()
    equal, _ = list_schedule(graph, ["dev0", "dev1"], speed=1e12, bandwidth=16e9)
    mixed, where = list_schedule(graph, ["dev0", "dev1"], speed={"dev0": 2e12, "dev1": 1e12},
                                 bandwidth=16e9)
    fast_alone, _ = list_schedule(graph, ["dev0"], speed=2e12, bandwidth=16e9)
    left, right = independent_parts(graph)
    branch_slow = sum(graph.ops[n].flops for n in right) / 1e12
    both_fast = sum(graph.ops[n].flops for n in left + right) / 2e12
    print(f"equal speeds {equal.makespan() * 1e6:.0f} us; dev0 twice as fast {mixed.makespan() * 1e6:.0f} us; "
          f"dev0 alone {fast_alone.makespan() * 1e6:.0f} us")
    print(f"one branch on the slow device {branch_slow * 1e6:.0f} us = both branches on the fast one "
          f"{both_fast * 1e6:.0f} us: the second device cannot help")
    assert abs(branch_slow - both_fast) < 1e-9
    assert abs(mixed.makespan() - fast_alone.makespan()) <= 0.01 * fast_alone.makespan()


def _fields(op):
    return {k: v for k, v in asdict(op).items() if k not in ("name", "deps")}


def exercise_4():
    """A deeper MLP: its middle gradient (256 x 256) is ready while backward still has the first
    layer to go, so its copy overlaps compute. Make every gradient copy wait for the end of its
    device's backward pass and reschedule: the step grows by what that overlap used to hide."""
    net, speeds = mlp((784, 256, 256, 10)), {"gpu0": 1e12, "gpu1": 1e12, "cpu": 5e10}
    step = data_parallel_graph(net, torch.rand(128, 1, 28, 28), devices=("gpu0", "gpu1"),
                               host="cpu")
    tl, _ = list_schedule(step, ["gpu0", "gpu1"], speed=speeds, bandwidth=16e9)
    hidden = tl.overlap("gpu0", "cpu<->gpu0")
    print(f"gradient copies overlapping compute on gpu0: {hidden * 1e6:.1f} us")
    last = {dev: [n for n, op in step.ops.items() if op.resource == dev
                  and op.label == "backward"][-1]
            for dev in ("gpu0", "gpu1")}  # insertion order: the last backward op ends the pass
    waiting, held = Graph(), {dev: [] for dev in last}
    for name, op in step.ops.items():  # same operations; each gradient copy also waits for `last`
        dev = next((d for d in last
                    if name.startswith("copy grad") and name.endswith(f"{d}->cpu")), None)
        if dev is not None:
            held[dev].append(op)
            continue
        waiting.add(name, op.deps, **_fields(op))
        for d, ops in held.items():
            if name == last[d]:
                for c in ops:
                    waiting.add(c.name, c.deps + [name], **_fields(c))
    for d, ops in held.items():  # copies inserted after the last backward op
        for c in ops:
            if c.name not in waiting.ops:
                waiting.add(c.name, c.deps + [last[d]], **_fields(c))
    tl_wait, _ = list_schedule(waiting, ["gpu0", "gpu1"], speed=speeds, bandwidth=16e9)
    print(f"predicted step: {tl.makespan() * 1e6:.1f} us with copies as soon as each gradient is "
          f"ready, {tl_wait.makespan() * 1e6:.1f} us if every copy waits for the whole backward")
    assert hidden > 0 and tl_wait.makespan() > tl.makespan()
    assert waiting.ancestors("update linear1") > step.ancestors("update linear1")
