"""``python -m d2lpar info``, ``python -m d2lpar bench <name>``, ``python -m d2lpar plan ...``,
``python -m d2lpar gpu``, ``python -m d2lpar quiet`` and ``python -m d2lpar solution NN`` (prints the
worked solutions of notebook NN, which ship with the package in ``d2lpar/solutions/``)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

BENCHMARKS = {
    "launch": "d2lpar.bench.launch",
    "overlap": "d2lpar.bench.overlap",
    "allreduce": "d2lpar.bench.allreduce",
    "ddp": "d2lpar.bench.ddp",
    "pipeline": "d2lpar.bench.pipeline",
    "tp": "d2lpar.bench.tp",
    "zero": "d2lpar.bench.zero",
    "memory": "d2lpar.bench.memory",
    "context": "d2lpar.bench.context",
    "expert": "d2lpar.bench.expert",
    "3d": "d2lpar.bench.threed",
}

SOLUTIONS = Path(__file__).resolve().parent / "solutions"


def solution_file(number: str, folder: Path = SOLUTIONS) -> Path:
    """The worked solutions of notebook ``number`` ("7", "07" or "07_ddp"); ValueError if none."""
    files = sorted(folder.glob("[0-9][0-9]_*.py"))
    digits = number.split("_")[0]
    found = [f for f in files if digits.isdigit() and f.name[:2] == f"{int(digits):02d}"]
    if not found:
        known = f"{files[0].name[:2]} to {files[-1].name[:2]}" if files else "none found"
        raise ValueError(f"no solutions for notebook {number!r}: give a number from {known}, "
                         "e.g. 14")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m d2lpar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what this machine has and what the course will simulate")
    gpu = sub.add_parser("gpu", help="on a CUDA machine: CUDA tests, notebooks and bench overlap, "
                         "with a report under build/gpu")
    gpu.add_argument("rest", nargs=argparse.REMAINDER, help="options (--parts ...)")
    plan = sub.add_parser("plan", help="the layout, ZeRO stage, micro-batches and checkpointing "
                          "that train a described model fastest on a described cluster")
    plan.add_argument("rest", nargs=argparse.REMAINDER, help="options (python -m d2lpar plan --help)")
    sub.add_parser("quiet", help="exit 1, saying why, when the machine is too busy to time anything")
    solution = sub.add_parser("solution", help="print the worked solutions of notebook NN "
                              "(the file's path comes first)")
    solution.add_argument("number", help="the notebook's number, e.g. 14")
    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options for the benchmark")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:   # its options start with --: hand them over before argparse sees them
        from d2lpar.cost.planner import main as plan_main
        return plan_main(argv[1:]) or 0
    args = parser.parse_args(argv)
    if args.command == "info":
        from d2lpar.info import machine_report
        print(machine_report())
        return 0
    if args.command == "gpu":
        from d2lpar.gpu_report import main as gpu_main
        return gpu_main(args.rest)
    if args.command == "solution":
        try:
            path = solution_file(args.number)
        except ValueError as e:
            print(f"python -m d2lpar solution: {e}", file=sys.stderr)
            return 2
        print(f"# {path}")
        print(path.read_text(), end="")
        return 0
    if args.command == "quiet":
        from d2lpar.infra.timing import quiet_or_exit
        return quiet_or_exit()
    module = importlib.import_module(BENCHMARKS[args.name])
    return module.main(args.rest) or 0


if __name__ == "__main__":
    sys.exit(main())
