"""Tensor-parallel step time: d2lpar's MLP and attention blocks against PyTorch's ``parallelize_module``.

On N gloo ranks (default 2) it builds each block once on one device, cuts it both ways (d2lpar's
``ParallelMLP`` / ``ParallelSelfAttention``, and ``parallelize_module`` with ``ColwiseParallel`` and
``RowwiseParallel`` on a CPU ``DeviceMesh``), checks that both give the single-device output, then
times a training step (forward and backward of the replicated input, the input's gradient included)
in interleaved rounds, in rotating order, keeping the fastest round (the slowest rank's time), as
``bench allreduce`` does. It prints each block's step time for both, their ratio, and the bytes one
rank sent per step, counted by ``count_comms``, against ``tp_cost.comm_formula`` (ring algorithms).
The last line states the worst d2lpar / PyTorch time ratio.

Ranks share this machine's cores: the figures compare two implementations of the same
communication here, not what GPUs would do (``d2lpar.cost.tp_cost.tp_step_time`` predicts that).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist

from d2lpar.cost import tp_cost
from d2lpar.processes.launch import launch
from d2lpar.strategies.tensor import mappings as tp
from d2lpar.strategies.tensor import blocks as B

BLOCKS = ("mlp", "attn")


def _worker(b, s, d, heads, hidden, blocks, rounds, round_s):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    t = dist.get_world_size()
    mesh = init_device_mesh("cpu", (t,))
    rows = []
    for name in blocks:
        torch.manual_seed(0)
        if name == "mlp":
            full = B.MLP(d, hidden)
            ours = B.ParallelMLP(d, hidden, full=full)
            plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        else:
            full = B.SelfAttention(d, heads)
            ours = B.ParallelSelfAttention(d, heads, full=full)
            plan = {"qkv": ColwiseParallel(), "out": RowwiseParallel()}
        theirs = parallelize_module(copy.deepcopy(full), mesh, plan)
        g = torch.Generator().manual_seed(1)
        x, gy = torch.randn(b, s, d, generator=g), torch.randn(b, s, d, generator=g)
        with torch.no_grad():
            expected = full(x)

        def step(block):
            xr = x.clone().requires_grad_()
            y = block(xr)
            y.backward(gy)
            for p in block.parameters():
                p.grad = None
            return y

        for who, block in (("d2lpar", ours), ("torch", theirs)):  # correctness, and warm-up
            got = step(block).detach()
            if not torch.allclose(torch.as_tensor(got), expected, rtol=1e-4, atol=1e-5):
                raise AssertionError(f"{who}'s {name} differs from one device")
        with tp.count_comms() as log:
            step(ours)
        want = tp_cost.comm_formula(name, b, s, d, t)
        sent, formula = log.sent(), want["forward"]["sent"] + want["backward"]["sent"]
        # steps per round: enough to fill round_s, agreed by all ranks
        dist.barrier()
        t0 = time.perf_counter()
        step(ours)
        once = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(once, op=dist.ReduceOp.MAX)
        reps = max(1, min(100, int(round_s / max(once.item(), 1e-6))))
        times = {"d2lpar": [], "torch": []}
        order = [("d2lpar", ours), ("torch", theirs)]
        for i in range(rounds):
            for who, block in order[i % 2:] + order[:i % 2]:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    step(block)
                elapsed = torch.tensor([(time.perf_counter() - t0) / reps])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[who].append(elapsed.item())
        rows.append({"block": name, "ours": min(times["d2lpar"]), "torch": min(times["torch"]),
                     "sent": sent, "formula": formula})
    return rows


def run(ranks=2, b=4, s=128, d=256, heads=8, hidden=1024, blocks=BLOCKS, rounds=7,
        round_s=0.3, timeout=600.0):
    """Measure; return one row per block (seconds per step, bytes sent and the formula's)."""
    return launch(_worker, ranks, b, s, d, heads, hidden, blocks, rounds, round_s,
                  timeout=timeout)[0]


def report(rows, ranks, b, s, d, heads, hidden) -> list[str]:
    lines = [f"# {ranks} ranks; activations (b, s, d) = ({b}, {s}, {d}), {heads} heads, MLP {hidden} "
             "wide, fp32; a step = forward + backward",
             f"{'block':>5} | {'d2lpar (ms)':>11} {'torch (ms)':>10} {'ratio':>6} | "
             f"{'sent/rank (B)':>13} {'formula (B)':>12} {'ratio':>6}"]
    worst = 0.0
    for r in rows:
        ratio = r["ours"] / r["torch"]
        worst = max(worst, ratio)
        lines.append(f"{r['block']:>5} | {r['ours'] * 1e3:>11.2f} {r['torch'] * 1e3:>10.2f} "
                     f"{ratio:>6.2f} | {r['sent']:>13,.0f} {r['formula']:>12,.0f} "
                     f"{r['sent'] / r['formula']:>6.3f}")
    verdict = "meets" if worst <= 1.2 else "misses"
    lines.append(f"worst d2lpar / parallelize_module step time ratio: {worst:.2f} ({verdict} the "
                 "target <= 1.2)")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m d2lpar bench tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks (default 2)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--width", type=int, default=256, help="d, the model width")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024, help="the MLP's width")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (best counts)")
    parser.add_argument("--round-time", type=float, default=0.3, help="seconds of steps per round")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 0.1 s: shorter, noisier")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.round_time = 3, 0.1
    for what, value in (("--width", args.width), ("--hidden", args.hidden), ("--heads", args.heads)):
        if value % args.ranks:
            parser.error(f"{what} {value} is not divisible by --ranks {args.ranks}")
    if args.width % args.heads:
        parser.error(f"--width {args.width} is not divisible by --heads {args.heads}")
    t0 = time.perf_counter()
    rows = run(args.ranks, args.batch, args.seq, args.width, args.heads, args.hidden,
               rounds=args.rounds, round_s=args.round_time)
    print(f"# tensor-parallel step on {args.ranks} gloo ranks of this machine, "
          f"{time.perf_counter() - t0:.1f} s in all")
    for line in report(rows, args.ranks, args.batch, args.seq, args.width, args.heads, args.hidden):
        print(line)
    return 0
