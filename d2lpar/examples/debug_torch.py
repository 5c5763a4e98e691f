"""Debugging hooks for a distributed script: one file, torch only, to copy into a training script.

torch only: no d2lpar. What it sets up, each a line or two:

* ``@record`` on ``main``: torchrun writes the first failing rank's exception, traceback and time to
  its error file and reports that rank;
* the flight recorder (``TORCH_FR_BUFFER_SIZE``, set here before ``init_process_group`` unless already
  set) and a ``--dump DIR`` option that writes every rank's buffer on a collective's timeout, for
  ``python -m torch.distributed.flight_recorder.fr_trace DIR -p rank_``;
* a short process-group ``--timeout`` while debugging, and ``dist.monitored_barrier`` at a suspect
  point (``--check``), which names the ranks that do not arrive (gloo);
* every thread's Python stack on demand: ``kill -USR1 <pid>`` makes a rank print it to stderr
  (``faulthandler``, armed in ``arm_stack_dumps``), without stopping it;
* ``--skip-on RANK`` plants the classic bug: that rank skips one all-reduce.

    torchrun --standalone --nproc-per-node=2 debug_torch.py --skip-on 1 --timeout 5 --dump fr
    torchrun --standalone --nproc-per-node=2 debug_torch.py --check --skip-on 1 --timeout 5
"""

import argparse
import faulthandler
import os
import pickle
import signal
import tempfile
from datetime import timedelta

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")   # before the process group exists

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


class Usage(Exception):  # bad input: printed as one sentence, without a traceback
    pass


def arm_stack_dumps() -> None:
    """``kill -USR1 <pid>`` then prints every thread's Python stack to stderr; the rank goes on."""
    if hasattr(signal, "SIGUSR1"):   # not on Windows
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def dump_flight_recorder(folder: str) -> str:
    """Write this rank's flight-recorder buffer as ``<folder>/rank_<r>`` (torch's analyzer format)."""
    os.makedirs(folder, exist_ok=True)
    data = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    if "" in data.get("pg_config", {}):   # gloo names the default group '' here and '0' in the entries
        data["pg_config"]["0"] = dict(data["pg_config"].pop(""), name="0", desc="default_pg")
    path = os.path.join(folder, f"rank_{dist.get_rank()}")
    with open(path, "wb") as f:
        pickle.dump(data, f)
    return path


@record
def main(argv=None) -> str:
    p = argparse.ArgumentParser(description="Debugging hooks for a distributed script (torch only).")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a collective may wait")
    p.add_argument("--skip-on", type=int, default=None, help="plant the bug: this rank skips one all-reduce")
    p.add_argument("--check", action="store_true", help="monitored_barrier before the suspect all-reduce")
    p.add_argument("--dump", default=None, help="folder for flight-recorder dumps on a timeout")
    args = p.parse_args(argv)
    arm_stack_dumps()
    if not args.timeout > 0:
        raise Usage(f"--timeout {args.timeout}: give the seconds a collective may wait, above 0")
    if "RANK" not in os.environ:
        raise Usage("start with torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")
    if missing := [v for v in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]:
        raise Usage(f"{', '.join(missing)} not set: start with torchrun, which sets them with RANK")
    try:  # now, not at the timeout the dump is for
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            tempfile.TemporaryFile(dir=args.dump).close()
    except OSError as e:
        raise Usage(f"cannot write to --dump {args.dump} ({e.strerror}): give a folder you can write")
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, outcome = dist.get_rank(), "finished"
    try:
        t = torch.ones(4)
        dist.all_reduce(t)
        if rank != args.skip_on:
            if args.check:
                dist.monitored_barrier(timeout=timedelta(seconds=args.timeout))
            dist.all_reduce(t)   # the suspect: inside a branch on the rank
        dist.all_reduce(torch.ones(4))
        dist.barrier()
    except RuntimeError as e:
        outcome = f"rank {rank}: {str(e).splitlines()[0]}"
        if args.dump:
            outcome += f"; flight recorder in {dump_flight_recorder(args.dump)}"
    print(outcome, flush=True)
    dist.destroy_process_group()
    return outcome


if __name__ == "__main__":
    import sys
    try:
        main()
    except Usage as e:
        sys.exit(f"debug_torch.py: error: {e}")
