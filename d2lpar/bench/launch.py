"""Start-up cost of N ranks: d2lpar.processes.launch (warm forkserver) against torch.multiprocessing.spawn.

Each run starts N ranks, joins a gloo group, does one all-reduce, and returns. Then ``--tail K``
warm launches of 4 ranks in a row give the median, the 95th percentile and the maximum (a launch
that stalls shows here, not in a median). The last line states the ratio d2lpar / mp.spawn for N = 4.

``--soak K`` instead launches 4 ranks K times in a row from this one process and prints the open file
descriptors and live child processes before and after, and the seconds taken: a launcher that leaks
shows it as growth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from d2lpar.processes.commands import descendants, free_port, open_fds
from d2lpar.processes.launch import launch


def _allreduce() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _spawned(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    _allreduce()
    dist.barrier()
    dist.destroy_process_group()


def time_launch(n: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = launch(_allreduce, n)
        times.append(time.perf_counter() - t0)
        assert out == [float(n)] * n, out
    return statistics.median(times)


def time_spawn(n: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tmp.spawn(_spawned, args=(n, free_port()), nprocs=n, join=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def launch_tail(launches: int, n: int = 4) -> tuple[float, float, float]:
    """Median, 95th percentile and maximum seconds of ``launches`` warm launches of ``n`` ranks."""
    launch(_allreduce, n, progress=None)
    times = []
    for _ in range(launches):
        t0 = time.perf_counter()
        assert launch(_allreduce, n, progress=None) == [float(n)] * n
        times.append(time.perf_counter() - t0)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.95 * len(times)))], times[-1]


def soak(launches: int, n: int = 4) -> dict:
    """Launch ``n`` ranks ``launches`` times; fds and children before/after, seconds in all."""
    launch(_allreduce, n)  # one-time state (forkserver, resource tracker) before counting
    before = (open_fds(), len(descendants() or ()))
    t0 = time.perf_counter()
    for _ in range(launches):
        assert launch(_allreduce, n) == [float(n)] * n
    seconds = time.perf_counter() - t0
    after = (open_fds(), len(descendants() or ()))
    return {"launches": launches, "ranks": n, "fds": (before[0], after[0]),
            "children": (before[1], after[1]), "seconds": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m d2lpar bench launch", description=__doc__)
    parser.add_argument("--ranks", default="2,4,8", help="world sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="launches per figure (median)")
    parser.add_argument("--spawn-repeats", type=int, default=1, help="mp.spawn runs per figure")
    parser.add_argument("--tail", type=int, default=100, metavar="K",
                        help="warm 4-rank launches for the median, 95th percentile and maximum")
    parser.add_argument("--soak", type=int, default=0, metavar="K",
                        help="launch 4 ranks K times; print fds, children and seconds")
    args = parser.parse_args(argv)
    if args.soak:
        r = soak(args.soak)
        print(f"{r['launches']} launches of {r['ranks']} ranks in {r['seconds']:.1f} s "
              f"({r['seconds'] / r['launches']:.3f} s each); open fds {r['fds'][0]} -> {r['fds'][1]}; "
              f"child processes {r['children'][0]} -> {r['children'][1]}")
        return 0 if r["fds"][0] == r["fds"][1] and r["children"][0] == r["children"][1] else 1
    sizes = [int(n) for n in args.ranks.split(",")]
    t0 = time.perf_counter()
    launch(_allreduce, 2)  # the first call starts the forkserver and imports torch there
    print(f"first d2lpar.processes.launch (starts the forkserver): {time.perf_counter() - t0:.3f} s")
    print(f"{'ranks':>5}  {'d2lpar.processes.launch':>14}  {'mp.spawn':>9}  {'ratio':>6}")
    ratios = {}
    for n in sizes:
        ours, theirs = time_launch(n, args.repeats), time_spawn(n, args.spawn_repeats)
        ratios[n] = ours / theirs
        print(f"{n:>5}  {ours:>12.3f} s  {theirs:>7.3f} s  {ratios[n]:>6.3f}")
    if args.tail:
        med, p95, worst = launch_tail(args.tail)
        print(f"{args.tail} warm launches of 4 ranks: median {med:.3f} s, 95th percentile {p95:.3f} s, "
              f"maximum {worst:.3f} s")
    key = 4 if 4 in ratios else sizes[-1]
    print(f"ratio d2lpar.processes.launch / mp.spawn for N = {key}: {ratios[key]:.3f}")
    return 0
