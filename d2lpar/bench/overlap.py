"""Compute while transferring: the four times and how close overlap comes to its limit.

On the CPU the transfer is a copy thread moving a large buffer (one torch thread). It runs first
beside a simulated device (a wait as long as the compute was measured to take, which leaves the CPU
free as a GPU's kernels do), then beside the main thread multiplying matrices (one torch thread),
where each job needs a core of its own. With a GPU
the same is measured with a second CUDA stream copying results to pinned host memory. Every time is
the best of ``--repeats`` runs. The last line is the verdict of the run: overlapped /
max(compute, transfer) (1.0 is perfect overlap; about 2 means none when the two parts are equally
long) and what that says, written from the numbers just measured.
"""

from __future__ import annotations

import argparse

import torch

from d2lpar.comm.cuda_streams import cuda_overlap
from d2lpar.comm.overlap import cpu_overlap, simulated_overlap
from d2lpar.infra.timing import load_line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m d2lpar bench overlap", description=__doc__)
    parser.add_argument("--target", type=float, default=0.1,
                        help="seconds each part should take on the CPU (default 0.1)")
    parser.add_argument("--copy-mb", type=float, default=32.0, help="MB per copy on the CPU")
    parser.add_argument("--repeats", type=int, default=7, help="runs per figure (the best counts)")
    parser.add_argument("--cpu", action="store_true", help="measure the CPU even if a GPU exists")
    args = parser.parse_args(argv)
    if torch.cuda.is_available() and not args.cpu:
        result = cuda_overlap("cuda", repeats=args.repeats)
    else:
        if not torch.cuda.is_available():
            print("No GPU here: measuring the CPU path (a copy thread beside the compute thread).")
        if load_line():
            print(load_line("other programs take cores from the two threads and push the ratio up"))
        print(simulated_overlap(target_s=args.target, copy_mb=args.copy_mb,
                                repeats=args.repeats).table())
        result = cpu_overlap(target_s=args.target, copy_mb=args.copy_mb, repeats=args.repeats)
    print(result.table())  # its last line is the verdict
    return 0
