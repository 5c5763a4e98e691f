"""Worked solutions to the exercises of notebook 09 (DDP from the inside)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from d2lpar.cost import buckets as bucket_cost
from d2lpar.cost.costmodel import MACHINES
from d2lpar.processes.launch import launch
from d2lpar.strategies.data.accumulation import accumulate_worker, check_no_sync
from d2lpar.strategies.data.ddp import DDP, TiedToy, assign_buckets


def _tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (n, 5), generator=g), torch.randint(0, 32, (n,), generator=g)


def _bucket_counts(caps):
    return [len(DDP(TiedToy(), cap).buckets) for cap in caps]


def exercise_1():
    """Buckets of TiedToy for three caps: predicted from the sizes, then built by DDP."""
    caps = [0.0001, 0.002, 25]
    params = [p for p in TiedToy().parameters() if p.requires_grad][::-1]  # the order of backward
    sizes = [p.numel() * p.element_size() for p in params]
    predicted = [len(assign_buckets(sizes, int(c * 2 ** 20))) for c in caps]
    built = launch(_bucket_counts, 2, caps, quiet=True)[0]
    for c, p, b in zip(caps, predicted, built):
        print(f"cap {c} MiB: predicted {p} bucket(s), DDP built {b}")
    assert predicted == built == [4, 2, 1]


def exercise_2():
    """Best cap on 8 GPUs behind NVSwitch for a 20 ms and a 200 ms backward."""
    machine = MACHINES["8 GPUs, NVSwitch"]
    a, b = bucket_cost.ring_terms(machine, machine.devices)
    G = 100e6
    best = {}
    for backward in (0.020, 0.060, 0.200):
        layers = [(backward / 400, int(G / 400))] * 400
        cap, run = bucket_cost.best_cap(layers, lambda k: a + k * b)
        best[backward] = bucket_cost.uniform_best_cap(backward, G, a, b)
        print(f"backward {backward * 1e3:.0f} ms: searched {cap / 2 ** 20:.3g} MiB "
              f"(step {run.step * 1e3:.2f} ms), closed form {best[backward] / 2 ** 20:.3g} MiB")
    print("Communication keeps up easily here, so the step is backward plus the last bucket; a "
          "longer backward leaves more time between buckets, so smaller buckets still keep up and "
          "the exposed last bucket shrinks: the closed form's best cap falls as backward grows. "
          "The search cannot follow it below a few layers per bucket (a bucket holds whole "
          "layers), and there the differences are microseconds.")
    assert best[0.200] < best[0.060] < best[0.020]


def _accumulate(micro):
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, y = _tokens(24)
    n = 24 // world
    return accumulate_worker(TiedToy(seed=rank), ids[rank * n:(rank + 1) * n],
                             y[rank * n:(rank + 1) * n], micro, cap_mb=0.002)


def exercise_3():
    """4 micro-batches per step on 3 ranks with no_sync: no all-reduce inside, == one process."""
    runs = launch(_accumulate, 3, 4, quiet=True)
    one = TiedToy(seed=0)
    ids, y = _tokens(24)
    nn.functional.cross_entropy(one(ids), y).backward()
    expected = {k: p.grad for k, p in one.named_parameters() if p.grad is not None}
    check_no_sync(runs, expected, micro=4)


def _compressed(how):
    rank = dist.get_rank()
    model = TiedToy(seed=0)
    ddp = DDP(model, 25, compress=how)
    ids, y = _tokens(12, seed=5)
    nn.functional.cross_entropy(ddp(ids[rank * 6:(rank + 1) * 6]), y[rank * 6:(rank + 1) * 6]).backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}, ddp.bucket_bytes()


def exercise_4():
    """bf16 against fp16: error of one averaged gradient, and bytes sent per bucket."""
    exact, fp32_bytes = launch(_compressed, 2, None, quiet=True)[0]
    errors = {}
    for how in ("fp16", "bf16"):
        grads, _ = launch(_compressed, 2, how, quiet=True)[0]
        errors[how] = max(((grads[k] - e).abs().max() / e.abs().max()).item() for k, e in exact.items())
        print(f"{how}: {sum(fp32_bytes) // 2} bytes per step instead of {sum(fp32_bytes)}; "
              f"error {errors[how]:.2g} of the largest entry")
    assert 0 < errors["fp16"] < errors["bf16"] <= 2 ** -6
