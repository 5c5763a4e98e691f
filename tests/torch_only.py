"""What the tests of the torch-only scripts (``d2lpar/examples``) share: a copy of a script loaded
with d2lpar blocked, and a path on which importing d2lpar fails, for the ranks torchrun starts."""

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


def blocked_env(folder: Path) -> dict[str, str]:
    """``{"PYTHONPATH": ...}`` whose first entry holds a ``d2lpar`` that raises when imported."""
    shadow = folder / "shadow" / "d2lpar"
    shadow.mkdir(parents=True, exist_ok=True)
    (shadow / "__init__.py").write_text("raise ImportError('a torch-only script imported d2lpar')\n")
    return {"PYTHONPATH": str(shadow.parent)}
