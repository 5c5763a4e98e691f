"""Inside the launcher's forkserver only: when the caller dies, end every rank and what it started.

The forkserver is preloaded with this module (``launch._forkserver``). On Linux, importing it there
asks the kernel to send the forkserver SIGTERM when the caller dies (``PR_SET_PDEATHSIG``), even by
SIGKILL; the handler kills each rank's process group (a rank leads its own group, so a
``subprocess`` or a ``sleep`` it started goes with it), then exits. Ranks also get SIGKILL from the
kernel when the forkserver ends. Nothing here needs a rank's Python thread: a rank busy in C code
that holds the GIL ends as promptly as an idle one.

Imported anywhere else (the caller, a test) it does nothing.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["in_forkserver", "kill_rank_groups"]

PR_SET_PDEATHSIG = 1


def in_forkserver() -> bool:
    """True in a multiprocessing forkserver (started as ``python -c 'from multiprocessing...'``)."""
    return sys.argv[:1] == ["-c"] and "multiprocessing.forkserver" in sys.modules


def kill_rank_groups(signum=None, frame=None) -> None:
    """SIGKILL the process group of every child of this process (each rank leads its own)."""
    from d2lpar.processes.commands import descendants
    me = os.getpid()
    for pid in descendants() or ():
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent == me:
                os.killpg(pid, signal.SIGKILL)
        except (OSError, ValueError):
            continue
    if signum is not None:
        os._exit(70)


def _arm() -> None:
    if not (sys.platform.startswith("linux") and in_forkserver()):
        return
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    signal.signal(signal.SIGTERM, kill_rank_groups)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:   # the caller died before the request was made
        kill_rank_groups(signal.SIGTERM)


_arm()
