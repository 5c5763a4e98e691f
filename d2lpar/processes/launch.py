"""Run a function on N ranks, from a notebook or a script, and get each rank's return value back.

``launch(fn, n, *args)`` starts n processes, joins them into one ``torch.distributed`` process group
and calls ``fn(*args)`` in each; inside, ``dist.get_rank()`` and ``dist.get_world_size()`` say who is
who, exactly as under ``torchrun``, so the worker you write here is the worker you later launch there.

How it differs from ``torch.multiprocessing.spawn``:

* ``fn`` may be defined in a notebook cell: it is serialized by value with cloudpickle.
* Processes come from a *forkserver* that has already imported torch, so after the first launch
  starting a rank costs a fork, not a Python start-up plus ``import torch``. Fork is taken from the
  server, never from the caller, so a caller that has initialised CUDA is safe.
* The rendezvous store is held by the caller on a free loopback port (no port race), and the
  backend is chosen for you: NCCL only when each rank gets a GPU of its own, gloo otherwise.
* Each rank's stdout/stderr is captured and printed by the caller after the run, rank by rank, so
  the output is the same on every run.
* Failures surface in the caller: the first rank that raises (or dies) stops the others and becomes
  one ``RankFailed`` error carrying its traceback; a run that exceeds ``timeout`` is killed and
  raises ``LaunchTimeout``. No process outlives the call.
* The group is closed with a barrier before ``destroy_process_group`` (without it, gloo ranks
  sometimes abort at exit).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import cloudpickle
import torch

from d2lpar.processes.commands import free_port

__all__ = ["launch", "choose_backend", "LaunchError", "RankFailed", "LaunchTimeout"]


class LaunchError(RuntimeError):
    """The ranks could not be started, or did not finish."""


class RankFailed(LaunchError):
    """A rank raised an exception or died; ``.rank`` names it, ``.remote_traceback`` is its traceback."""

    def __init__(self, rank: int, world_size: int, remote_traceback: str, output: str = ""):
        self.rank, self.world_size = rank, world_size
        self.remote_traceback, self.output = remote_traceback, output
        text = f"rank {rank} of {world_size} failed:\n\n{remote_traceback.rstrip()}"
        if output.strip():
            text += f"\n\nrank {rank} printed:\n{output.rstrip()}"
        super().__init__(text)


class LaunchTimeout(LaunchError):
    """Some ranks had not finished when the timeout ran out; they were stopped."""


# ----------------------------------------------------------------------------------------- backend

_said: set[tuple] = set()


def choose_backend(world_size: int, backend: str = "auto") -> tuple[str, str]:
    """Return ``(backend, reason)``: NCCL needs one GPU per rank, gloo runs anywhere."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = torch.distributed.is_nccl_available() and gpus > 0
    if backend == "auto":
        if nccl and gpus >= world_size:
            return "nccl", (f"{gpus} GPU(s) for {world_size} rank(s): one GPU per rank, so NCCL "
                            "for CUDA tensors, with gloo for CPU tensors")
        if gpus == 0:
            return "gloo", "no GPU here, so gloo on the CPU"
        return "gloo", (f"{world_size} ranks but {gpus} GPU(s): NCCL needs a GPU per rank, so gloo "
                        "on the CPU")
    if backend == "nccl":
        if not nccl:
            raise LaunchError("backend='nccl' needs CUDA GPUs and a torch built with NCCL, and this "
                              "machine has neither: use backend='gloo' (or 'auto')")
        if gpus < world_size:
            raise LaunchError(f"backend='nccl' needs one GPU per rank: {world_size} ranks but {gpus} "
                              f"GPU(s). Launch at most {gpus} ranks, or use backend='gloo'")
        return "nccl", "asked for"
    if backend == "gloo":
        return "gloo", "asked for"
    raise LaunchError(f"unknown backend {backend!r}: use 'auto', 'gloo' or 'nccl'")


# ------------------------------------------------------------------------------------ rank process

def _set_parent_death_signal() -> None:
    """Ask Linux to kill this rank if the process that forked it (the forkserver) goes away."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _rank_main(rank: int, world_size: int, payload: bytes, conn, env: dict, backend: str,
               threads: int, timeout_s: float, capture: bool, init_group: bool) -> None:
    _set_parent_death_signal()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
    torch.set_num_threads(threads)
    out = io.StringIO()
    if capture:
        sys.stdout = sys.stderr = out
    message: tuple
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        import torch.distributed as dist
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if init_group:
            # With NCCL, CPU tensors still need a backend: gloo carries them, NCCL the CUDA ones.
            group_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                                  is_master=False, timeout=timedelta(seconds=timeout_s))
            dist.init_process_group(group_backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        result = fn(*args, **kwargs)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        message = ("ok", cloudpickle.dumps(result))
    except BaseException:
        message = ("error", traceback.format_exc(), time.time())
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    try:
        conn.send(message + (out.getvalue(),))
    except Exception:  # the result itself could not be pickled
        conn.send(("error", traceback.format_exc(), time.time(), out.getvalue()))
    conn.close()


# ---------------------------------------------------------------------------------------- launcher

_context = None


def _forkserver():
    """The multiprocessing context; its server imports torch once, then forks ranks from there."""
    global _context
    if _context is None:
        if "forkserver" in mp.get_all_start_methods():
            _context = mp.get_context("forkserver")
            _context.set_forkserver_preload(["torch", "torch.distributed", "cloudpickle", "d2lpar.processes.launch"])
        else:  # Windows and others: slower, but correct
            _context = mp.get_context("spawn")
    return _context


@contextlib.contextmanager
def _main_not_rerun():
    """Start ranks without re-running the caller's ``__main__`` in them.

    multiprocessing normally re-imports the main script (or module) in every child so that functions
    defined there can be found by name. Ranks receive ``fn`` by value, so that is pure cost (for
    ``python -m pytest`` it imports pytest in every rank), and a script without an
    ``if __name__ == "__main__":`` guard would launch itself again from every rank.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


def _open_store(addr: str, port: int, world_size: int, timeout_s: float):
    """Host the rendezvous store in the caller: binding port 0 picks a free port with no race."""
    import torch.distributed as dist
    if port:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError:
                raise LaunchError(f"port {port} on {addr} is in use: pass master_port=0 to let the "
                                  "launcher pick a free port, or choose another") from None
    return dist.TCPStore(addr, port, world_size, is_master=True,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def _stop(procs) -> None:
    procs = [p for p in procs if p.pid is not None]  # a rank whose start failed has nothing to stop
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "auto",
           timeout: float = 120.0, threads_per_rank: int = 1, capture_output: bool = True,
           quiet: bool = False, init_process_group: bool = True, master_addr: str = "127.0.0.1",
           master_port: int = 0, env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the list of their return values.

    backend: 'auto' (NCCL with one GPU per rank, else gloo), 'gloo' or 'nccl'.
    timeout: seconds for the whole run (and for each collective); on expiry every rank is stopped.
    threads_per_rank: torch compute threads per rank (1 keeps simulated ranks from fighting for cores).
    capture_output: capture each rank's output and print it after the run, prefixed and in rank
        order (False lets ranks write to the terminal as they go, interleaved).
    quiet: with capture_output, discard what the ranks print instead.
    init_process_group: False leaves the call to ``dist.init_process_group()`` to ``fn``, with
        MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK set for ``init_method='env://'``.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise LaunchError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if timeout <= 0:
        raise LaunchError(f"timeout must be positive, got {timeout!r}")
    chosen, reason = choose_backend(world_size, backend)
    if backend == "auto" and (chosen, reason) not in _said:
        _said.add((chosen, reason))
        print(f"launch: backend {chosen} ({reason})")
    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise LaunchError(f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the "
                          f"ranks: {type(e).__name__}: {e}. Pass only picklable values (tensors, "
                          "numbers, modules); create locks, files and sockets inside the worker") from e

    ctx = _forkserver()
    store = None
    if init_process_group:
        store = _open_store(master_addr, master_port, world_size, timeout)
        port = store.port
    else:
        port = master_port or free_port(master_addr)
    shared_env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
                  "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                  "OMP_NUM_THREADS": str(threads_per_rank), **(env or {})}

    procs, readers = [], []
    try:
        with _main_not_rerun():
            _start_ranks(ctx, procs, readers, world_size, payload, shared_env, chosen,
                         threads_per_rank, timeout, capture_output, init_process_group)
        results, outputs = _collect(procs, readers, world_size, timeout)
    finally:
        _stop(procs)
        for r in readers:
            r.close()
        del store
    if capture_output and not quiet:
        for rank, text in enumerate(outputs):
            for line in text.rstrip("\n").splitlines():
                print(f"[rank {rank}] {line}")
    return results


def _start_ranks(ctx, procs, readers, world_size, payload, env, backend, threads, timeout,
                 capture, init_group) -> None:
    for rank in range(world_size):
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, name=f"d2lpar-rank{rank}",
                        args=(rank, world_size, payload, writer, env, backend, threads, timeout,
                              capture, init_group))
        procs.append(p)
        readers.append(reader)
        p.start()
        writer.close()


def _collect(procs, readers, world_size: int, timeout: float):
    """Wait for every rank's message; raise on the first failure or at the deadline."""
    deadline = time.monotonic() + timeout
    results: list[Any] = [None] * world_size
    outputs = [""] * world_size
    errors: list[tuple[float, int, str, str]] = []
    pending = set(range(world_size))
    error_deadline = None
    while pending:
        now = time.monotonic()
        if error_deadline is not None and now >= error_deadline:
            break
        limit = min(deadline, error_deadline or deadline) - now
        if limit <= 0:
            break
        waitables = {readers[r]: r for r in pending}
        waitables.update({procs[r].sentinel: r for r in pending})
        for obj in mp.connection.wait(list(waitables), timeout=limit):
            rank = waitables[obj]
            if rank not in pending:
                continue
            reader = readers[rank]
            if reader.poll():
                try:
                    msg = reader.recv()
                except (EOFError, OSError):
                    msg = None
            elif obj is reader:
                msg = None
            else:
                procs[rank].join(0.5)  # exited: give the message (if any) a moment to arrive
                msg = reader.recv() if reader.poll(0.5) else None
            if msg is None:
                procs[rank].join(1.0)
                code = procs[rank].exitcode
                why = (f"was killed by signal {signal.Signals(-code).name}" if code and code < 0
                       else f"exited with code {code}")
                msg = ("error", f"the process {why} before returning a result\n", time.time(), "")
            pending.discard(rank)
            if msg[0] == "ok":
                results[rank], outputs[rank] = cloudpickle.loads(msg[1]), msg[2]
            else:
                errors.append((msg[2], rank, msg[1], msg[3]))
                # Other ranks usually fail a moment later because this one left; wait briefly so
                # that the earliest failure, the cause, is the one reported.
                error_deadline = error_deadline or time.monotonic() + 0.5
    if errors:
        _, rank, tb, out = min(errors)
        raise RankFailed(rank, world_size, tb, out)
    if pending:
        raise LaunchTimeout(f"ranks {sorted(pending)} of {world_size} had not finished after "
                            f"{timeout:g} s and were stopped. A rank waiting in a collective that "
                            "another rank never reaches hangs like this; raise timeout= if the work "
                            "is just slow")
    return results, outputs
