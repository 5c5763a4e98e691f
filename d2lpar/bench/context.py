"""``python -m d2lpar bench context``: ring attention and Ulysses on 2 and 4 ranks.

For each: the bytes one rank sent (forward and backward of one attention layer) / the formula of
``d2lpar.cost.context_cost`` (exactly 1), and the largest difference from ``scaled_dot_product_attention``
on one device (output and gradients). Then ring attention's timing with a calibrated device wait per
block (``d2lpar.strategies.context.timing``): the overlapped ring against the sum and the max of the
blocks' compute and the transfers (target: overlapped / max <= 1.15). Last line: the worst ratio.
"""

from __future__ import annotations

import argparse

import torch

from d2lpar.cost import context_cost as CC
from d2lpar.processes.launch import launch
from d2lpar.strategies.context import ring as R
from d2lpar.strategies.context.timing import ring_overlap
from d2lpar.strategies.context.ulysses import ulysses_attention


def _worker(q, k, v, W, method, causal, zigzag):
    import torch.distributed as dist
    n, r = dist.get_world_size(), dist.get_rank()
    parts = [R.split_sequence(t, n, zigzag)[r].clone().requires_grad_() for t in (q, k, v)]
    counter = {}
    if method == "ring":
        out = R.ring_attention(*parts, causal=causal, zigzag=zigzag, counter=counter)
    else:
        out = ulysses_attention(*parts, causal=causal, counter=counter)
    (out * R.split_sequence(W, n, zigzag)[r]).sum().backward()
    return out.detach(), [p.grad for p in parts], counter["sent"]


def check_run(method, n, b=2, heads=4, S=48, dh=8, causal=True, zigzag=False):
    """(bytes sent by rank 0 / formula, largest difference from one device) for one configuration."""
    g = torch.Generator().manual_seed(0)
    q, k, v, W = (torch.randn(b, heads, S, dh, generator=g) for _ in range(4))
    res = launch(_worker, n, q, k, v, W, method, causal, zigzag, quiet=True, timeout=60)
    out = R.merge_sequence([r[0] for r in res], zigzag)
    grads = [R.merge_sequence([r[1][i] for r in res], zigzag) for i in range(3)]
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = R.reference_attention(qq, kk, vv, causal)
    (ref * W).sum().backward()
    diff = max([(out - ref.detach()).abs().max().item()] +
               [(a - t.grad).abs().max().item() for a, t in zip(grads, (qq, kk, vv))])
    formula = (CC.ring_bytes if method == "ring" else CC.ulysses_bytes)(b, S, heads * dh, n)
    return res[0][2] / (2 * formula), diff   # forward and backward send as much


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m d2lpar bench context", description=__doc__)
    p.add_argument("--wait-ms", type=float, default=None,
                   help="device time per block (ms; default: 3 times one block's transfer)")
    args = p.parse_args(argv)
    ratios = []
    print(f"{'method':<22}{'ranks':>6}{'bytes / formula':>17}{'max |diff|':>12}")
    for method, zigzag in (("ring", False), ("ring, zig-zag", True), ("ulysses", False)):
        for n in (2, 4):
            ratio, diff = check_run(method.split(",")[0], n, zigzag=zigzag)
            ratios.append(ratio)
            print(f"{method:<22}{n:>6}{ratio:>17.3f}{diff:>12.1e}")
    for n in (2, 4):
        wait = None if args.wait_ms is None else args.wait_ms / 1e3
        t = launch(ring_overlap, n, 1, 128, 4, 1024, wait, quiet=True, timeout=120)[0]
        a, c, o = t["compute"], t["transfer"], t["overlapped"]
        print(f"ring on {n} ranks: compute {a * 1e3:.1f} ms, transfers {c * 1e3:.1f} ms, sum "
              f"{(a + c) * 1e3:.1f} ms, overlapped {o * 1e3:.1f} ms = {o / max(a, c):.2f}x the max")
        ratios.append(o / max(a, c))
    worst = max(ratios, key=lambda r: abs(r - 1))
    print(f"worst ratio: {worst:.3f}")
    return 0
