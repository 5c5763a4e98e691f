"""``python -m d2lpar bench expert``: expert parallelism on 2 and 4 ranks with E = 4 and 8, k = 1 and 2.

For each: the bytes rank 0 sent to dispatch and combine / the count from the routing
(``d2lpar.cost.expert_cost.routed_bytes``, exactly 1), and the largest difference from the same
mixture on one device (output, experts' and router's gradients). Last line: the worst ratio.
"""

from __future__ import annotations

import argparse

import torch

from d2lpar.cost.expert_cost import routed_bytes
from d2lpar.processes.launch import launch
from d2lpar.strategies.expert.dispatch import ExpertParallelMoE
from d2lpar.strategies.expert.moe import MoE


def ep_worker(X, W, d, hidden, E, k, capacity_factor):
    """In a launched rank: this rank's output, its experts' gradients, the summed router gradient,
    the bytes it sent, and its routing's kept assignments per expert."""
    import torch.distributed as dist
    n, r = dist.get_world_size(), dist.get_rank()
    full = MoE(d, hidden, E, k, capacity_factor)
    ep = ExpertParallelMoE(d, hidden, E, k, capacity_factor, full=full)
    out = ep(X.chunk(n)[r])
    (out * W.chunk(n)[r]).sum().backward()
    router = ep.router.weight.grad.clone()
    dist.all_reduce(router)
    kept = torch.bincount(ep.last.expert[ep.last.kept], minlength=E)
    return {"out": out.detach(), "w1": ep.experts.w1.grad, "w2": ep.experts.w2.grad, "router": router,
            "sent": ep.counter.get("sent", 0), "kept": kept.tolist(), "dropped": ep.last.dropped}


def compare(n, E, k, T=64, d=8, hidden=16, capacity_factor=None):
    g = torch.Generator().manual_seed(0)
    X, W = torch.randn(T, d, generator=g), torch.randn(T, d, generator=g)
    res = launch(ep_worker, n, X, W, d, hidden, E, k, capacity_factor, quiet=True, timeout=60)
    full = MoE(d, hidden, E, k, capacity_factor)
    (full(X) * W).sum().backward()
    diff = max((torch.cat([r["out"] for r in res]) - full(X).detach()).abs().max().item(),
               (torch.cat([r["w1"] for r in res]) - full.experts.w1.grad).abs().max().item(),
               (torch.cat([r["w2"] for r in res]) - full.experts.w2.grad).abs().max().item(),
               (res[0]["router"] - full.router.weight.grad).abs().max().item())
    dispatch, combine = routed_bytes([r["kept"] for r in res], 0, E // n, d)
    return res[0]["sent"] / (dispatch + combine), diff, res


def main(argv=None) -> int:
    argparse.ArgumentParser(prog="python -m d2lpar bench expert", description=__doc__).parse_args(argv)
    ratios = []
    print(f"{'ranks':>5}{'E':>4}{'k':>3}{'bytes / formula':>17}{'max |diff|':>12}")
    for n in (2, 4):
        for E in (4, 8):
            for k in (1, 2):
                ratio, diff, _ = compare(n, E, k)
                ratios.append(ratio)
                print(f"{n:>5}{E:>4}{k:>3}{ratio:>17.3f}{diff:>12.1e}")
    worst = max(ratios, key=lambda r: abs(r - 1))
    print(f"worst ratio: {worst:.3f}")
    return 0
