"""All-reduce bandwidth, nccl-tests style: dist.all_reduce, the hand-built ring, a parameter server.

For each world size N and message size S (float32, summed in place) it prints the time per call, the
algorithm bandwidth algbw = S / time and the bus bandwidth busbw = algbw * 2(N-1)/N (what each link
carried, comparable across N; nccl-tests' definition), for ``dist.all_reduce`` (gloo here, NCCL on
GPUs), ``d2lpar.comm.collectives.ring_all_reduce`` and ``d2lpar.comm.param_server.ps_all_reduce`` (one
server). Methods are timed in interleaved rounds, in rotating order, so that a slow moment of the
machine hits all of them alike, and the fastest round counts (as ``timeit`` advises: other processes
on a shared machine only ever add time; the time is the slowest rank's). The last line states the
largest ring / all_reduce time ratio at 16 MB and 64 MB.

Several ranks on a few CPU cores share those cores: the figures show the algorithms' relative costs
on this machine, not what a GPU cluster would do (see ``d2lpar.cost.costmodel`` for that).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from d2lpar.comm.collectives import ring_all_reduce
from d2lpar.comm.param_server import ps_all_reduce
from d2lpar.processes.launch import launch

METHODS = ("all_reduce", "ring", "ps")


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def _human(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _worker(sizes, methods, rounds, round_s, segments, ps_servers):
    """On every rank: per size, time each method in interleaved rounds; return the best rounds."""
    n = dist.get_world_size()
    calls = {"all_reduce": lambda t: (dist.all_reduce(t), t)[1],
             "ring": lambda t: ring_all_reduce(t, segments=segments),
             "ps": lambda t: ps_all_reduce(t, servers=ps_servers)}
    rows = []
    for nbytes in sizes:
        numel = max(1, nbytes // 4)
        # Correctness first (and warm-up): every method gives dist.all_reduce's answer.
        x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
        expected = x.clone()
        dist.all_reduce(expected)
        for m in methods:
            got = calls[m](x.clone())
            if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
                raise AssertionError(f"{m} differs from dist.all_reduce at {nbytes} bytes")
        buf = torch.zeros(numel)  # zeros stay zeros however often they are summed
        # Calls per round: enough to fill round_s, agreed by all ranks.
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        once = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(once, op=dist.ReduceOp.MAX)
        reps = max(1, min(1000, int(round_s / max(once.item(), 1e-6))))
        times = {m: [] for m in methods}
        for i in range(rounds):
            for m in methods[i % len(methods):] + methods[:i % len(methods)]:  # rotate the order
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    calls[m](buf)
                elapsed = torch.tensor([(time.perf_counter() - t0) / reps])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[m].append(elapsed.item())
        rows.append((n, nbytes, {m: min(v) for m, v in times.items()}))
    return rows


def run(ranks, sizes, methods=METHODS, rounds=9, round_s=0.02, segments=None, ps_servers=1,
        timeout=600.0):
    """Measure; return ``[(N, bytes, {method: seconds per call}), ...]``."""
    rows = []
    for n in ranks:
        rows += launch(_worker, n, sizes, methods, rounds, round_s, segments, ps_servers,
                       timeout=timeout)[0]
    return rows


def report(rows, methods=METHODS) -> list[str]:
    """The table, nccl-tests style, and the closing ratio line."""
    head = f"{'N':>2} {'size':>8} {'count':>9} |"
    sub = f"{'':>2} {'':>8} {'(floats)':>9} |"
    for m in methods:
        head += f" {m:^27} |"
        sub += f" {'time(us)':>9} {'algbw':>8} {'busbw':>8} |"
    head += " ring/all_reduce" if {"ring", "all_reduce"} <= set(methods) else ""
    lines = ["# float32 sum in place; algbw, busbw in GB/s; busbw = algbw * 2(N-1)/N", head, sub]
    worst = None
    for n, nbytes, t in rows:
        line = f"{n:>2} {_human(nbytes):>8} {max(1, nbytes // 4):>9} |"
        for m in methods:
            algbw = nbytes / t[m] / 1e9
            line += f" {t[m] * 1e6:>9.1f} {algbw:>8.3f} {algbw * 2 * (n - 1) / n:>8.3f} |"
        if {"ring", "all_reduce"} <= set(methods):
            ratio = t["ring"] / t["all_reduce"]
            line += f" {ratio:>8.2f}"
            if nbytes in (16 << 20, 64 << 20):
                worst = ratio if worst is None else max(worst, ratio)
        lines.append(line)
    if worst is None:
        lines.append("largest ring / all_reduce time ratio at 16 MB and 64 MB: not measured "
                     "(include those sizes and both methods)")
    else:
        verdict = "meets" if worst <= 1.2 else "misses"
        lines.append(f"largest ring / all_reduce time ratio at 16 MB and 64 MB: {worst:.2f} "
                     f"({verdict} the target <= 1.2)")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m d2lpar bench allreduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated (default 2,4)")
    parser.add_argument("--min-size", default="1K", help="smallest message (default 1K)")
    parser.add_argument("--max-size", default="64M", help="largest message (default 64M)")
    parser.add_argument("--factor", type=int, default=4, help="size step factor (default 4; 2 "
                        "gives every power of two, as nccl-tests -f 2)")
    parser.add_argument("--rounds", type=int, default=9,
                        help="interleaved rounds per size (the best counts)")
    parser.add_argument("--round-time", type=float, default=0.02,
                        help="seconds of calls per method per round (at least one call)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="subset of " + ",".join(METHODS))
    parser.add_argument("--segments", type=int, default=None,
                        help="pieces per ring message (default: chosen by size)")
    parser.add_argument("--ps-servers", type=int, default=1, help="parameter-server shards")
    parser.add_argument("--quick", action="store_true", help="sizes 1K, 16K, 1M, 16M, 64M and 3 "
                        "rounds: shorter, and noisier")
    args = parser.parse_args(argv)
    lo, hi = _parse_size(args.min_size), _parse_size(args.max_size)
    if lo < 4 or hi < lo or args.factor < 2:
        parser.error("need 4 <= --min-size <= --max-size and --factor >= 2")
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= args.factor
    if args.quick:
        sizes = sorted({z for z in sizes if z in (1 << 10, 16 << 10, 1 << 20, 16 << 20, 64 << 20)})
        args.rounds = min(args.rounds, 3)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if not set(methods) <= set(METHODS) or not methods:
        parser.error(f"--methods: choose from {','.join(METHODS)}")
    ranks = [int(r) for r in args.ranks.split(",")]
    t0 = time.perf_counter()
    rows = run(ranks, sizes, methods, args.rounds, args.round_time, args.segments, args.ps_servers)
    print(f"# all-reduce on N gloo ranks of this machine, {time.perf_counter() - t0:.1f} s in all")
    for line in report(rows, methods):
        print(line)
    return 0
