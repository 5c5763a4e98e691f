"""What the tests of the torch-only scripts (``d2lpar/examples``) share: a copy of a script loaded
with d2lpar blocked, in this process or on ranks started as torchrun would start them."""

from __future__ import annotations

import runpy
import shutil
import sys
from pathlib import Path

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")


def load_copy(script: Path, folder: Path, monkeypatch) -> dict:
    """Copy ``script`` into ``folder`` and run it as a module (not __main__) with d2lpar blocked."""
    copy = folder / script.name
    shutil.copy(script, copy)
    with monkeypatch.context() as m:
        for name in [n for n in list(sys.modules) if n.split(".")[0] == "d2lpar"] + ["d2lpar"]:
            m.setitem(sys.modules, name, None)  # importing it now raises ModuleNotFoundError
        return runpy.run_path(str(copy), run_name=f"copy_of_{script.stem}")


def _main_of_copy(copy: str, argv: list[str]):
    """In a rank: run the copied script as a module (not __main__) and call its ``main(argv)``, with
    every d2lpar module blocked while it runs (the rank's own machinery is already imported)."""
    blocked = [n for n in list(sys.modules) if n.split(".")[0] == "d2lpar"]
    saved = {n: sys.modules[n] for n in blocked}
    sys.modules.update({n: None for n in blocked})   # importing one now raises ModuleNotFoundError
    try:
        return runpy.run_path(copy, run_name="torch_only_copy")["main"](argv)
    finally:
        sys.modules.update(saved)


def run_in_ranks(copy: Path, world_size: int, argv: list[str], timeout: float = 120.0) -> list:
    """The copied script's ``main(argv)`` on ``world_size`` ranks started by the course's launcher,
    with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) and the process group left to the script, as under torchrun. A warm launch costs
    a fraction of a second where a torchrun start costs 5-9 s here; the notebooks run the scripts
    under torchrun itself (07, 08, 11, 13). d2lpar is blocked in the ranks while the script runs."""
    import cloudpickle

    from d2lpar.processes.launch import launch
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return launch(_main_of_copy, world_size, str(copy), [str(a) for a in argv],
                  init_process_group=False, timeout=timeout)
