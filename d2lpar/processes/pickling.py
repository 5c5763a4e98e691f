"""How the launcher sends a worker to its ranks: cloudpickle, with each function's file name kept.

cloudpickle 3.1.3 names every code object it sends ``<dynamic-code>`` (so that a payload does not
depend on where it was made). A rank's traceback and its stack at a timeout would then say
``<dynamic-code> line 12`` instead of the test, script or notebook cell where the worker was written;
``dumps`` puts the real file name back. With an older cloudpickle it is ``cloudpickle.dumps``.
"""

from __future__ import annotations

import io
import types
from collections import ChainMap

import cloudpickle

__all__ = ["dumps"]

_cloudpickle_code_reduce = getattr(getattr(cloudpickle, "cloudpickle", None), "_code_reduce", None)


def _code_reduce_keeping_file(code: types.CodeType):
    """cloudpickle's reducer for a code object, with the code's own file name kept."""
    make, args = _cloudpickle_code_reduce(code)
    return make, tuple(code.co_filename if isinstance(a, str) and a == "<dynamic-code>" else a
                       for a in args)


class _Pickler(cloudpickle.Pickler):
    if _cloudpickle_code_reduce is not None:
        dispatch_table = ChainMap({types.CodeType: _code_reduce_keeping_file},
                                  cloudpickle.Pickler.dispatch_table)


def dumps(obj) -> bytes:
    """``cloudpickle.dumps(obj)``, with the file names of the functions it carries kept."""
    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    return buffer.getvalue()
