"""Start-up cost of N ranks: d2lpar.processes.launch (warm forkserver) against torch.multiprocessing.spawn.

Each run starts N ranks, joins a gloo group, does one all-reduce, and returns. Then ``--tail K``
warm launches of 4 ranks in a row give the median, the 95th percentile and the maximum (a launch
that stalls shows here, not in a median). Every launch slower than ``--slow`` seconds is printed
with the phase that held it up (``d2lpar.processes.phases``: fork, start, rendezvous, work, close,
results, exit, logs), and a table gives each phase's median, 95th percentile and maximum over the
K launches. The last line states the ratio d2lpar / mp.spawn for N = 4.

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

from d2lpar.infra.timing import load_line
from d2lpar.processes.commands import descendants, free_port, open_fds
from d2lpar.processes.launch import last_phases, launch
from d2lpar.processes.phases import phase_table


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


def launch_tail(launches: int, n: int = 4, slow: float = float("inf"),
                say=print) -> tuple[float, float, float, list]:
    """Median, 95th percentile and maximum seconds of ``launches`` warm launches of ``n`` ranks,
    and each launch's phases; ``say`` gets the phases of each launch slower than ``slow`` s."""
    launch(_allreduce, n, progress=None)
    times, phases = [], []
    for i in range(launches):
        t0 = time.perf_counter()
        assert launch(_allreduce, n, progress=None) == [float(n)] * n
        times.append(time.perf_counter() - t0)
        phases.append(last_phases())
        if times[-1] > slow:
            load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
            say(f"launch {i + 1} of {launches}{load}: {phases[-1].line()}")
    ranked = sorted(times)
    return (statistics.median(ranked), ranked[min(len(ranked) - 1, int(0.95 * len(ranked)))],
            ranked[-1], phases)


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
    parser.add_argument("--slow", type=float, default=0.3, metavar="S",
                        help="print the phases of each of those launches slower than S seconds "
                             "(default 0.3)")
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
    if load_line():
        print(load_line())
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
        med, p95, worst, phases = launch_tail(args.tail, slow=args.slow)
        print(f"phases of the {args.tail} warm launches (each ends when its last rank is done):")
        print("\n".join("  " + line for line in phase_table(phases)))
        if load_line():
            print(load_line().replace("before", "after"))
        print(f"{args.tail} warm launches of 4 ranks: median {med:.3f} s, 95th percentile {p95:.3f} s, "
              f"maximum {worst:.3f} s")
    key = 4 if 4 in ratios else sizes[-1]
    print(f"ratio d2lpar.processes.launch / mp.spawn for N = {key}: {ratios[key]:.3f}")
    return 0
