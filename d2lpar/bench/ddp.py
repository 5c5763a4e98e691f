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

``--exit-aborts N`` instead counts aborts at exit: N times, two fresh Python processes (as torchrun
starts them) train with the course's DDP for ``--steps`` steps, close the group (barrier, then
``destroy_process_group``) and exit through the interpreter's shutdown, beside ``--busy`` processes
that only spin; a run whose rank dies by a signal or prints "terminate called" counts
(``d2lpar.comm.drain`` explains the abort). Two things prevent it, and each can be switched off:
``--pinned`` imports the course's DDP (and with it torch.distributed.nn.functional) after the
group exists, as torch.optim's first step imports it in a script, so ``destroy_process_group``
leaves gloo's threads running; ``--no-drain`` skips the DDP's wait for those threads to let go of
its buckets after each backward. With both, the runs are those of the DDP before the drain.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

from d2lpar.cost.buckets import against_measured, fit_terms
from d2lpar.infra.timing import load_line
from d2lpar.processes.launch import launch
from d2lpar.strategies.data.ddp_timing import (COMPUTE_OVER_COMM, overlap_worker, sweep_worker,
                                         versus_torch_worker)


# One rank of the exit check, run as ``python -c`` with rank, world, store, steps, pinned, drain.
EXIT_RANK = """
import sys
rank, world, store, steps, pinned, drain = sys.argv[1:7]
rank, world, steps, pinned, drain = int(rank), int(world), int(steps), pinned == "1", drain == "1"
import torch
import torch.distributed as dist
if not pinned:   # a script imports first, then makes its group
    from d2lpar.strategies.data import ddp
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
if pinned:       # imported after the group exists: torch.distributed.nn.functional pins it
    from d2lpar.strategies.data import ddp
if not drain:
    ddp.let_go = lambda tensors, timeout=0.0: True
DDP = ddp.DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]), 0.01)
g = torch.Generator().manual_seed(rank)
for step in range(steps):
    model(torch.randn(16, 64, generator=g)).square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.01)
            p.grad = None
dist.barrier()
dist.destroy_process_group()
"""


def _how_it_ended(rank: int, proc: subprocess.Popen) -> str:
    """'' for a rank that exited with 0 and printed no "terminate called"; else what happened."""
    try:
        out = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"rank {rank} did not end in 120 s (stopped)"
    code = proc.returncode
    if code < 0:
        said = f"rank {rank} killed by {signal.Signals(-code).name}"
    elif code:
        said = f"rank {rank} exit code {code}"
    else:
        said = ""
    if "terminate called" in out:
        said = (said or f"rank {rank}") + ' ("terminate called ...")'
    return said


def exit_aborts(runs: int, busy: int = 2, steps: int = 5, pinned: bool = False,
                drain: bool = True, world: int = 2, say=print) -> int:
    """Run the 2-rank training ``runs`` times beside ``busy`` spinning processes; the number of
    runs in which a rank died by a signal, printed "terminate called" or did not end in 120 s."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    bad = 0
    try:
        for run in range(runs):
            with tempfile.TemporaryDirectory(prefix="d2lpar-exit-") as folder:
                cmd = [sys.executable, "-c", EXIT_RANK]
                ranks = [subprocess.Popen(cmd + [str(r), str(world), os.path.join(folder, "store"),
                                                 str(steps), str(int(pinned)), str(int(drain))],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True) for r in range(world)]
                said = [_how_it_ended(r, proc) for r, proc in enumerate(ranks)]
            if any(said):
                bad += 1
                say(f"run {run + 1} of {runs}: " + "; ".join(s for s in said if s))
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    return bad


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
    parser.add_argument("--exit-aborts", type=int, default=0, metavar="N",
                        help="instead: run a 2-rank training N times as fresh processes and count "
                             "the runs in which a rank aborts at exit")
    parser.add_argument("--busy", type=int, default=2,
                        help="with --exit-aborts: spinning processes beside the ranks (default 2)")
    parser.add_argument("--steps", type=int, default=5,
                        help="with --exit-aborts: training steps per run (default 5)")
    parser.add_argument("--pinned", action="store_true",
                        help="with --exit-aborts: import the DDP after making the group")
    parser.add_argument("--no-drain", action="store_true",
                        help="with --exit-aborts: no wait for gloo's threads to let go (see above)")
    args = parser.parse_args(argv)
    if args.exit_aborts:
        if args.exit_aborts < 0 or args.busy < 0 or args.steps < 1:
            parser.error("need --exit-aborts >= 1, --busy >= 0 and --steps >= 1")
        if load_line():
            print(load_line())
        off = [what for what, on in (("group pinned", args.pinned), ("no drain", args.no_drain))
               if on]
        print(f"{args.exit_aborts} runs: 2 fresh processes, {args.steps} steps of the course's DDP"
              f"{' (' + ', '.join(off) + ')' if off else ''}, then exit; {args.busy} busy "
              "processes beside")
        t0 = time.perf_counter()
        bad = exit_aborts(args.exit_aborts, args.busy, args.steps, args.pinned, not args.no_drain)
        if load_line():
            print(load_line().replace("before", "after"))
        print(f"exit aborts: {bad} of {args.exit_aborts} runs ({time.perf_counter() - t0:.0f} s)")
        return 1 if bad else 0
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
