"""pytest settings for the whole checkout, found by every pytest command run from it.

``make test`` and an instructor's plain ``pytest --nbval-lax notebooks/`` (virtual environment
active, no Makefile) must run the same way, so the settings live here, not in the Makefile: every
file a run writes goes under ``build/``, notebooks run in this environment's kernel with the
course's sanitizing rules and a cell timeout, and the run ends with each notebook's duration.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent
BUILD = ROOT / "build"

# Set before any kernel or rank starts, so that they inherit them; a value already set wins.
for name, folder in {"D2LPAR_BUILD_DIR": BUILD, "MPLCONFIGDIR": BUILD / "matplotlib",
                     "IPYTHONDIR": BUILD / "ipython",
                     "JUPYTER_RUNTIME_DIR": BUILD / "jupyter-runtime"}.items():
    os.environ.setdefault(name, str(folder))
os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")  # no .pyc files in the checkout

NBVAL_CELL_TIMEOUT = 600.0  # seconds; nbval's own default is 2000


def pytest_configure(config) -> None:
    option = config.option
    if hasattr(option, "nbval_sanitize_with"):  # nbval is installed (it is, with d2lpar[dev])
        if option.nbval_sanitize_with is None:
            option.nbval_sanitize_with = str(ROOT / "tests" / "nbval_sanitize.cfg")
        option.nbval_current_env = True  # the kernel of this environment, not the notebook's own
        if option.nbval_cell_timeout == 2000:
            option.nbval_cell_timeout = NBVAL_CELL_TIMEOUT
    from tests import nbval_durations
    if not config.pluginmanager.is_registered(nbval_durations):
        config.pluginmanager.register(nbval_durations, "nbval_durations")
