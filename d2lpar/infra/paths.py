"""Where the course writes files: ``build_dir()``.

Checkpoints, scripts written by notebooks and logs go under one folder, so that running the course
leaves the rest of the checkout untouched. It is ``$D2LPAR_BUILD_DIR`` when set (the Makefile sets it
to ``build/`` in the checkout), else ``d2lpar-build`` in the system's temporary folder.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["build_dir"]


def build_dir(*parts: str) -> Path:
    """The build folder (or a folder inside it), created if needed."""
    root = os.environ.get("D2LPAR_BUILD_DIR") or os.path.join(tempfile.gettempdir(), "d2lpar-build")
    path = Path(root, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
