"""Where the course writes files: ``build_dir()``.

Checkpoints, scripts written by notebooks and logs go under one folder, so that running the course
leaves the rest of the checkout untouched. It is ``$D2LPAR_BUILD_DIR`` when set (the Makefile and
the repository's ``conftest.py`` set it to ``build/`` in the checkout), else a folder of the user's
own: ``$XDG_CACHE_HOME/d2lpar`` (``~/.cache/d2lpar`` on Linux), ``%LOCALAPPDATA%\\d2lpar`` on
Windows. Never a folder shared between users: on a classroom's shared server a second student
could neither write into the first one's folder nor keep their runs apart.

A folder that cannot be created or written is refused with one sentence that names it and the
variable that moves it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["build_dir", "default_root", "BuildDirError"]

VARIABLE = "D2LPAR_BUILD_DIR"


class BuildDirError(OSError):
    """The build folder cannot be written; the message says which folder and what to do."""


def default_root() -> Path:
    """The user's own folder for the course's files when ``$D2LPAR_BUILD_DIR`` is not set."""
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"], "d2lpar")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache, "d2lpar")


def build_dir(*parts: str) -> Path:
    """The build folder (or a folder inside it), created if needed."""
    root = os.environ.get(VARIABLE) or str(default_root())
    path = Path(root, *parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
        writable = os.access(path, os.W_OK | os.X_OK)
    except OSError as e:
        raise BuildDirError(f"cannot create the course's build folder {path} ({e.strerror}): set "
                            f"{VARIABLE} to a folder you can write") from None
    if not writable:
        raise BuildDirError(f"cannot write to the course's build folder {path}: set {VARIABLE} "
                            f"to a folder you can write") from None
    return path
