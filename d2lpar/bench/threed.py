"""``python -m d2lpar bench 3d``: the hand-built and the torch 3D runs timed, and the planner checked.

Prints (1) the step times of the character GPT on dp x tp x pp = 2 x 2 x 2 ranks, built by hand
(``threed.hand.run_3d``) and with torch's APIs (``examples/threed_torch.py``), real compute on this
machine's cores, and their ratio (target <= 1.3); (2) for six 8-rank layouts on simulated devices,
the planner's predicted step time with this machine's fitted costs, the measured one and their ratio
(target: within 25 % each), and whether the fastest measured layout is among the planner's top two.
"""

from __future__ import annotations

import argparse

from d2lpar.cost.planner_check import check_here
from d2lpar.infra.text import CharCorpus, batches, make_text
from d2lpar.infra.timing import load_line
from d2lpar.strategies.threed.gpt import char_gpt
from d2lpar.strategies.threed.hand import run_3d
from d2lpar.strategies.threed.torch_api import run_torch_3d

LAYOUTS = [(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 2, 4), (2, 1, 4), (1, 4, 2)]


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m d2lpar bench 3d", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warm-up)")
    p.add_argument("--rate", type=float, default=1e9, help="simulated device FLOP/s for the layouts")
    a = p.parse_args(argv)
    print(load_line("timings"))
    corpus = CharCorpus(make_text())
    small = char_gpt(corpus.vocab, 32, layers=4, d=64, heads=4)
    B = batches(corpus.ids, 16, 32, a.steps + 1)
    hand = run_3d(small, B, dp=2, tp=2, pp=2, microbatches=2, gather=False)
    torch3d = run_torch_3d(small, B, dp=2, tp=2, pp=2, microbatches=2)
    th, tt = _median(hand.step_times[1:]), _median(torch3d.step_times[1:])
    print(f"\n3D, dp 2 x tp 2 x pp 2, 4 layers of width 64, batch 16 x 32 characters, real compute:")
    print(f"  hand-built {th * 1e3:8.1f} ms/step   torch (fully_shard x parallelize_module x pipelining) "
          f"{tt * 1e3:8.1f} ms/step   hand / torch {th / tt:.2f}  (target <= 1.3: "
          f"{'met' if th / tt <= 1.3 else 'not met'})")
    gpt = char_gpt(corpus.vocab, 32, layers=8, d=64, heads=8)
    fit, rows = check_here(gpt, batches(corpus.ids, 32, 32, max(2, a.steps // 2)), LAYOUTS, 4, a.rate)
    print(f"\nplanner against measurement: 8 layers, width 64, 8 heads, batch 32 x 32, 4 micro-batches, "
          f"simulated devices of {a.rate:.2g} FLOP/s")
    print(f"  fitted: compute share {fit.utilisation:.2f}, all-reduce latency {fit.latency * 1e3:.2f} ms, "
          f"bandwidth {fit.bandwidth / 1e6:.0f} MB/s")
    print(f"  {'dp x tp x pp':>12} {'predicted':>10} {'measured':>10} {'ratio':>6}")
    for r in rows:
        dp, tp, pp = r.layout
        print(f"  {f'{dp} x {tp} x {pp}':>12} {sum(r.predicted.values()) * 1e3:8.0f}ms "
              f"{r.measured * 1e3:8.0f}ms {r.ratio:6.2f}")
    worst = max(rows, key=lambda r: abs(r.ratio - 1))
    top2 = sorted(rows, key=lambda r: sum(r.predicted.values()))[:2]
    best = min(rows, key=lambda r: r.measured)
    print(f"  furthest from 1: {worst.ratio:.2f} ({'within' if abs(worst.ratio - 1) <= 0.25 else 'outside'} "
          f"25 %); fastest measured {best.layout} is {'among' if best in top2 else 'not among'} "
          f"the planner's top two")
    return 0
