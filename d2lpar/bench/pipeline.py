"""Pipeline schedules on real ranks: the measured bubble against the formula and the simulator, and
d2lpar's executor against ``torch.distributed.pipelining``.

Part 1 (step time): GPipe and 1F1B on p = 2 ranks, m = 8 micro-batches, real compute: the median
step time of d2lpar's executor and of torch's schedules on the same model and data, and their ratio.

Part 2 (bubble): for p in {2, 4}, m in {1, 2, 4, 8, 16} and each schedule (naive only with m = 1,
interleaved with v = 2 only when p divides m), each action lasts a calibrated time (``--tf`` for a
forward, twice that for a backward; I and W one each; the real computation is small and the rest is
a wait standing in for a device), so that p ranks behave like p devices on a machine with fewer
cores. The idle fraction is measured from the ranks' timelines (mean over ranks; median of three
timed steps after one warm-up step), and printed beside the formula (``d2lpar.cost.bubble``), the
simulator with the same durations, and the simulator given also what this run measured on the
ranks: the median message latency (a sender's end to a waiting receiver's start) and the median gap
between two actions of a rank (posting receives, sending; per schedule), the latency pooled over
all runs on p ranks, since a run has few receivers that waited. The formula assumes both are zero,
so the measured bubble sits above it; the simulator with them should meet the measurement. The line
before last is the largest |measured - formula|, the last the largest |measured - simulated with
latency| (late wake-ups on a busy machine push both up).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from d2lpar.cost import bubble
from d2lpar.infra.timing import Span, Timeline, load_line
from d2lpar.processes.launch import launch
from d2lpar.strategies.pipeline import schedules as P
from d2lpar.strategies.pipeline.simulator import median, simulate, waits
from d2lpar.strategies.pipeline.executor import check_stages, idle_fractions, run_schedule, split_model
from d2lpar.strategies.pipeline.torch_api import torch_pipeline_worker


def _model(width: int, depth: int = 8, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _durations(s: P.Schedule, tf: float) -> dict[str, float]:
    v = s.stages_per_rank
    return {"F": tf / v, "B": 2 * tf / v, "I": tf, "W": tf}


def _bench_worker(runs, X, y, repeats: int, warmup: int):
    """Each run: (schedule, stages, shapes, wait); returns per run this rank's spans of each timed
    step and the wall time of each timed step."""
    rank, out = dist.get_rank(), []
    for schedule, stages, shapes, wait in runs:
        mine = {s: stages[s] for s in schedule.stages_of(rank)}
        for _ in range(warmup):
            run_schedule(schedule, mine, X, y, nn.functional.cross_entropy, shapes, wait)
        times, steps = [], []
        for _ in range(repeats):
            for mod in mine.values():
                mod.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            res = run_schedule(schedule, mine, X, y, nn.functional.cross_entropy, shapes, wait)
            times.append(time.perf_counter() - t0)
            steps.append(res["spans"])
        out.append({"steps": steps, "times": times})
    return out


def step_times(p: int = 2, m: int = 8, width: int = 512, batch: int = 512, repeats: int = 10) -> list[tuple]:
    """[(schedule, d2lpar median s, torch median s)] for GPipe and 1F1B with real compute."""
    X, y = torch.randn(batch, width, generator=torch.Generator().manual_seed(0)), torch.arange(batch) % 10
    names = ["GPipe", "1F1B"]
    ours = [P.make_schedule(n, p, m) for n in names]
    runs = [(s, split_model(_model(width), p), check_stages(split_model(_model(width), p), X, m), None)
            for s in ours]
    mine = launch(_bench_worker, p, runs, X, y, repeats, 1, timeout=300)
    theirs = launch(torch_pipeline_worker, p, [(n, split_model(_model(width), p)) for n in names], X, y, m,
                    repeats=repeats + 1, timeout=300)
    rows = []
    for i, n in enumerate(names):
        d2 = statistics.median(max(r[i]["times"][k] for r in mine) for k in range(repeats))
        th = statistics.median(max(r[n]["times"][k] for r in theirs) for k in range(1, repeats + 1))
        rows.append((n, d2, th))
    return rows


class BubbleRow(NamedTuple):
    p: int
    m: int
    schedule: str
    measured: float     # mean idle fraction over the ranks, from their timelines
    formula: float      # d2lpar.cost.bubble: no latency, no overhead
    simulated: float    # the simulator with the same durations (equals the formula)
    latency: float      # seconds: median message latency over every run on these p ranks
    overhead: float     # seconds: median gap between two actions of a rank in this run
    with_latency: float  # the simulator given the durations, the latency and the overhead


def bubbles(ps=(2, 4), ms=(1, 2, 4, 8, 16), tf: float = 0.02, repeats: int = 3) -> list[BubbleRow]:
    """One BubbleRow per (p, m, schedule), measured with calibrated waits: the median over
    ``repeats`` timed steps (one action that overruns on a busy machine moves one step, not the
    figure)."""
    X, y = torch.randn(16 * 4, 32, generator=torch.Generator().manual_seed(0)), torch.arange(64) % 10
    rows = []
    for p in ps:
        runs = []
        for m in ms:
            for name in P.SCHEDULES:
                if (name == "naive" and m != 1) or (name == "interleaved 1F1B" and m % p):
                    continue
                s = P.make_schedule(name, p, m, 2 if name == "interleaved 1F1B" else None)
                stages = split_model(_model(32), s.stages)
                runs.append((s, stages, check_stages(stages, X, s.microbatches), _durations(s, tf)))
        results = launch(_bench_worker, p, runs, X, y, repeats, 1, timeout=600)
        steps = [[Timeline(Span(*sp) for r in results for sp in r[i]["steps"][k]) for k in range(repeats)]
                 for i in range(len(runs))]
        # the message latency is the machine's: pooled over every run on these p ranks (a run has
        # few waiting receivers); the gap between actions is the executor's, per schedule
        lat = median([x for tls, run in zip(steps, runs) for tl in tls for x in waits(tl, run[0])[0]])
        for tls, (s, _, _, wait) in zip(steps, runs):
            measured = statistics.median(statistics.fmean(idle_fractions(tl, p)) for tl in tls)
            formula = bubble.idle_fraction(s.name, p, s.microbatches, s.stages_per_rank)
            ovh = median([x for tl in tls for x in waits(tl, s)[1]])
            rows.append(BubbleRow(p, s.microbatches, s.name, measured, formula, simulate(s, wait).bubble,
                                  lat, ovh, simulate(s, wait, latency=lat, overhead=ovh).bubble))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m d2lpar bench pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tf", type=float, default=0.02, help="seconds a forward lasts (default 0.02)")
    parser.add_argument("--quick", action="store_true",
                        help="m in {1, 4, 8}, 5 timed steps of real compute, one of each bubble")
    parser.add_argument("--skip-torch", action="store_true", help="skip the comparison with torch")
    args = parser.parse_args(argv)
    if load_line():
        print(load_line("a busy machine wakes ranks late and adds to the measured bubble"))
    if not args.skip_torch:
        print("step time, real compute, p=2, m=8 (median):")
        for name, d2, th in step_times(repeats=5 if args.quick else 10):
            print(f"  {name:>5}: d2lpar {d2 * 1e3:7.1f} ms, torch.distributed.pipelining {th * 1e3:7.1f} ms, "
                  f"ratio {d2 / th:.2f} (target <= 1.2)")
    rows = bubbles(ms=(1, 4, 8) if args.quick else (1, 2, 4, 8, 16), tf=args.tf,
                   repeats=1 if args.quick else 3)
    print(table(rows))
    return 0


def table(rows: list[BubbleRow]) -> str:
    """The rows, then the largest gap to the formula and the largest to the simulator with latency."""
    lines = [f"{'p':>2} {'m':>3} {'schedule':>17} {'measured':>8} {'formula':>7} {'sim':>6} "
             f"{'lat ms':>6} {'ovh ms':>6} {'sim+lat':>7} {'-formula':>8} {'-sim+lat':>8}"]
    for r in rows:
        lines.append(f"{r.p:>2} {r.m:>3} {r.schedule:>17} {r.measured:>8.3f} {r.formula:>7.3f} "
                     f"{r.simulated:>6.3f} {r.latency * 1e3:>6.2f} {r.overhead * 1e3:>6.2f} "
                     f"{r.with_latency:>7.3f} {r.measured - r.formula:>+8.3f} "
                     f"{r.measured - r.with_latency:>+8.3f}")
    lines.append("sim+lat: the simulator given the measured median message latency (lat, over all "
                 "runs on p ranks)")
    lines.append("         and the median gap between two actions of a rank (ovh, this run)")
    for what, col, target in (("formula", "formula", 0.03), ("simulated with latency", "with_latency", 0.02)):
        w = max(rows, key=lambda r: abs(r.measured - getattr(r, col)))
        lines.append(f"largest |measured - {what}|: {abs(w.measured - getattr(w, col)):.3f} "
                     f"({w.schedule}, p={w.p}, m={w.m}; target <= {target})")
    return "\n".join(lines)
