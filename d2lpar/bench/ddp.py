"""DDP benchmarks: d2lpar's DDP against torch's, overlap of all-reduce with backward, bucket caps.

On 2 ranks (gloo on the CPU here, NCCL with a GPU per rank), one MLP of ``--depth`` hidden
``Linear(width, width)`` layers, with the same bucket cap for both DDPs:

1. **step time, real compute**: forward + backward + all-reduce of d2lpar's DDP over torch's
   (best of ``--repeats`` interleaved rounds each; both must give the same gradients);
2. **overlap, device time**: backward runs on a simulated device whose layers take
   ``--compute-over-comm`` times the measured all-reduce time in all (a GPU's kernels leave the CPU
   free; ``d2lpar.infra.device_time``), the gradients and all-reduces stay real; the DDP step over
   max(compute, communication) (1.0 is perfect overlap), beside compute then communicate; then the
   ratio again with a backward only 1.5 times the all-reduce, where two ranks on a 2-core CPU run
   out of cores for their real gradients and gloo's threads;
3. **bucket caps**: the device-time backward + all-reduce for several caps, and the prediction of
   ``d2lpar.cost.buckets`` from a and b fitted, in the same run, to one bucket of several sizes
   copied in, all-reduced and copied out as DDP does; it says whether the model agrees.

The last line states the two ratios (targets: at most 1.10 and 1.15) and the bucket model's worst
gap. On a shared CPU other programs take cores from the ranks and from gloo's threads: the load
average is printed first.
"""

from __future__ import annotations

import argparse

from d2lpar.cost.buckets import against_measured, fit_terms
from d2lpar.infra.timing import load_line
from d2lpar.processes.launch import launch
from d2lpar.strategies.data.ddp_timing import (COMPUTE_OVER_COMM, overlap_worker, sweep_worker,
                                         versus_torch_worker)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m d2lpar bench ddp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--cap-mb", type=float, default=1.0, help="bucket cap in MiB (default 1)")
    parser.add_argument("--width", type=int, default=512, help="layer width (default 512)")
    parser.add_argument("--depth", type=int, default=8, help="hidden layers (default 8)")
    parser.add_argument("--repeats", type=int, default=30,
                        help="rounds per figure, the best counts (default 30: on a shared CPU the "
                             "best of many rounds is what the code can do, the rest is waiting)")
    parser.add_argument("--compute-over-comm", type=float, default=COMPUTE_OVER_COMM,
                        help="device time of backward over the all-reduce time (default "
                             f"{COMPUTE_OVER_COMM:g})")
    parser.add_argument("--caps", type=float, nargs="*", default=[1, 2, 4, 25],
                        help="bucket caps in MiB for the sweep (none: skip it)")
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.cap_mb <= 0 or args.repeats < 1 or args.compute_over_comm <= 0:
        parser.error("need --ranks >= 2, --cap-mb > 0, --repeats >= 1 and --compute-over-comm > 0")
    if load_line():
        print(load_line())
    shape = dict(width=args.width, depth=args.depth)
    print(f"{args.ranks} ranks, MLP {args.depth} x Linear({args.width}, {args.width}), "
          f"bucket cap {args.cap_mb:g} MiB")

    vs = launch(versus_torch_worker, args.ranks, cap_mb=args.cap_mb, repeats=args.repeats,
                timeout=300, **shape)[0]
    if not vs["same_gradients"]:
        raise SystemExit("d2lpar's DDP and torch's gave different gradients: a bug, please report")
    step_ratio = vs["d2lpar"] / vs["torch"]
    print(f"step, real compute (batch 64 per rank): d2lpar DDP {vs['d2lpar'] * 1e3:.1f} ms, "
          f"torch DDP {vs['torch'] * 1e3:.1f} ms, same gradients")

    coc = args.compute_over_comm
    ov = launch(overlap_worker, args.ranks, cap_mb=args.cap_mb, repeats=args.repeats,
                compute_over_comm=coc, timeout=300, **shape)[0]
    print(f"overlap, device time ({len(ov['bucket_bytes'])} buckets; the transfer (copies + "
          f"all-reduces) calibrated at {ov['comm_s'] * 1e3:.1f} ms before,\n  so backward's device "
          f"time is {coc:g} x that = {sum(ov['layer_s']) * 1e3:.1f} ms):")
    print("\n".join(ov["result"].table().splitlines()[1:]))
    if coc != 1.5:
        tight = launch(overlap_worker, args.ranks, cap_mb=args.cap_mb, repeats=args.repeats,
                       compute_over_comm=1.5, timeout=300, **shape)[0]["result"]
        print(f"  the same with backward = 1.5 x the transfer: compute {tight.compute * 1e3:.1f} ms, "
              f"transfer {tight.transfer * 1e3:.1f} ms,\n  overlapped {tight.overlapped * 1e3:.1f} ms, "
              f"ratio {tight.ratio:.3f}\n  {tight.verdict()}")
    model_said = ""
    if args.caps:
        sweep = launch(sweep_worker, args.ranks, args.caps, repeats=max(3, args.repeats // 5),
                       compute_over_comm=coc, timeout=300, **shape)[0]
        a, b = fit_terms(sweep["sizes"], sweep["allreduce"])
        scale = sweep["compute"] / sum(s for s, _ in sweep["layers"])
        layers = [(s * scale, n) for s, n in sweep["layers"]]
        print(f"bucket caps (device time; one bucket copied in, all-reduced, copied out: fitted as "
              f"{a * 1e3:.2f} ms + {b * 1e9:.2f} ns/byte; backward alone "
              f"{sweep['compute'] * 1e3:.1f} ms):")
        table, verdict = against_measured(sweep["rows"], layers, a, b)
        print("\n".join("  " + line for line in table + verdict))
        model_said = f"; bucket model: {verdict[0]}"
    print(f"ratios: d2lpar DDP / torch DDP step = {step_ratio:.3f} (target <= 1.10); "
          f"overlapped / max(compute, communication) = {ov['result'].ratio:.3f} (target <= 1.15; "
          f"backward = {coc:g} x the all-reduce){model_said}")
    return 0
