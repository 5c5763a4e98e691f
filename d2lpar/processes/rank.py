"""What runs inside a rank: the caller's environment, output into a log, a stack on request, an exit with the caller.

A rank is forked from the forkserver, so it starts with the *forkserver's* state: the environment of
the first launch, the terminal of the first caller, a parent (the forkserver) that outlives the
caller. ``main`` replaces each piece before calling ``fn``:

* the environment is the caller's at this launch (``os.environ`` cleared, then filled), and
  ``TORCH_DISTRIBUTED_DEBUG``, which torch reads once at import, is read again;
* file descriptors 1 and 2 point at the rank's log file, so C++, C and subprocess output land there
  as well as Python's (``capture_fds``); ``flush_all`` empties the C library's buffers at the end;
* ``faulthandler`` is armed on SIGUSR1 and writes the Python stack of every thread to
  ``rank<r>.stack`` when the caller asks (``arm_stack_dump``);
* the rank leads a process group of its own, so that the launcher can end what it started;
* a thread waits on the *parent sentinel*, a pipe that only the caller holds open, and ends the
  rank's group when the caller is gone, even after a SIGKILL (``_exit_with_caller``); on Linux the
  kernel also kills the rank when the forkserver ends (``PR_SET_PDEATHSIG``), and the forkserver
  ends with the caller (``forkserver_guard``).

The result or the traceback goes back to the caller through a pipe; see ``launch`` and ``ranklog``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import cloudpickle
import torch

from d2lpar.processes.ranklog import FN_RETURNED, LEFT_GROUP, RAISED_MARK, STACK_SIGNAL

__all__ = ["main", "main_not_rerun", "capture_fds", "arm_stack_dump", "note", "flush_all"]


def _set_parent_death_signal() -> None:
    """Linux: ask the kernel to kill this rank when the process that forked it (the forkserver) ends."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # no glibc: the caller watch below still ends the rank


def _exit_with_caller() -> None:
    """End this rank when the caller dies, even by SIGKILL.

    multiprocessing gives each child a *parent sentinel*: the read end of a pipe whose write end
    only the caller holds, so it becomes readable exactly when the caller is gone. (The forkserver
    cannot do this for its ranks: each rank holds the pipe that keeps the forkserver alive.)
    """
    parent = mp.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if sentinel is None:
        return

    def watch():
        mp.connection.wait([sentinel])
        if hasattr(os, "killpg"):
            os.killpg(0, signal.SIGKILL)   # the rank's group: itself and what it started
        os._exit(70)
    threading.Thread(target=watch, name="d2lpar-caller-watch", daemon=True).start()


def main(rank: int, world_size: int, payload: bytes, conn, env: dict, backend: str, threads: int,
         timeout_s: float, log: str, stack: str, capture: bool, rendezvous: str | None) -> None:
    """The body of rank ``rank``: set it up as the docstring says, run ``fn``, send what came of it.

    The message ends with the moments (``time.time()``) at which this rank ended each of its
    phases (``phases``): set up, joined the group, ``fn`` returned, the group closed.
    """
    marks: dict[str, float] = {}
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)   # a group of its own: what the rank starts can be ended with it
    _set_parent_death_signal()
    _exit_with_caller()
    os.environ.clear()
    os.environ.update(env)  # the caller's environment at this launch, not the forkserver's
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
    if capture:
        capture_fds(log)
    arm_stack_dump(stack)
    torch.set_num_threads(threads)
    message: tuple
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        marks["ready"] = time.time()
        import torch.distributed as dist
        dist.set_debug_level_from_env()  # read once at import, in the forkserver: read it again
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if rendezvous is not None:   # the launcher's file store (see launch's docstring for why)
            # With NCCL, CPU tensors still need a backend: gloo carries them, NCCL the CUDA ones.
            group_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
            store = dist.FileStore(rendezvous, world_size)
            store.set_timeout(timedelta(seconds=timeout_s))
            dist.init_process_group(group_backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
            marks["joined"] = time.time()
        result = fn(*args, **kwargs)
        marks["worked"] = time.time()
        note(FN_RETURNED)
        left = rendezvous is not None and not dist.is_initialized()   # fn closed our group itself
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        marks["closed"] = time.time()
        message = ("ok", cloudpickle.dumps(result)) + ((LEFT_GROUP,) if left else ())
    except BaseException as e:  # the traceback starts below this frame, in the student's code
        tb = e.__traceback__.tb_next or e.__traceback__
        message = ("raised", "".join(traceback.format_exception(type(e), e, tb)), time.time())
        print(f"{RAISED_MARK}\n{message[1]}", file=sys.stderr, flush=True)
    flush_all()
    try:
        conn.send(message + (marks,))
    except Exception:  # the result itself could not be pickled
        conn.send(("raised", traceback.format_exc(), time.time()))
    conn.close()


@contextlib.contextmanager
def main_not_rerun():
    """Start ranks without re-running the caller's ``__main__`` in them.

    multiprocessing normally re-imports the main script (or module) in every child so that functions
    defined there can be found by name. Ranks receive ``fn`` by value, so that is pure cost (for
    ``python -m pytest`` it imports pytest in every rank), and a script without an
    ``if __name__ == "__main__":`` guard would launch itself again from every rank.
    """
    module = sys.modules.get("__main__")
    saved = {k: module.__dict__[k] for k in ("__file__", "__spec__") if module and k in module.__dict__}
    try:
        if module is not None:
            module.__dict__.pop("__file__", None)
            module.__spec__ = None
        yield
    finally:
        if module is not None:
            module.__dict__.update(saved)


def capture_fds(path: str) -> None:
    """Point file descriptors 1 and 2 at ``path``, with line-buffered ``sys.stdout``/``sys.stderr``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")


_stack_file = None


def arm_stack_dump(path: str) -> None:
    """On STACK_SIGNAL, write every thread's Python stack to ``path`` (the main thread's ident
    first)."""
    global _stack_file
    if STACK_SIGNAL is None or not hasattr(faulthandler, "register"):
        return
    _stack_file = open(path, "w")
    _stack_file.write(f"# main thread 0x{threading.main_thread().ident:016x}\n")
    _stack_file.flush()
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)


def flush_all() -> None:
    """Flush Python's streams and the C library's (``printf`` output buffered in the process)."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    if os.name == "posix":
        try:
            import ctypes
            ctypes.CDLL(None).fflush(None)
        except (OSError, AttributeError):
            pass


def note(text: str) -> None:
    """Add a line to the stack file, read with the stack (e.g. that fn has returned)."""
    if _stack_file is not None:
        _stack_file.write(f"# {text}\n")
        _stack_file.flush()
