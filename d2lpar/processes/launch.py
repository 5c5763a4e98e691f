"""Run a function on N ranks, from a notebook or a script, and get each rank's return value back.

``launch(fn, n, *args)`` starts n processes, joins them into one ``torch.distributed`` process group
and calls ``fn(*args)`` in each; inside, ``dist.get_rank()`` and ``dist.get_world_size()`` say who is
who, exactly as under ``torchrun``, so the worker you write here is the worker you later launch there.

How it differs from ``torch.multiprocessing.spawn``:

* ``fn`` may be defined in a notebook cell: it is serialized by value with cloudpickle. Bad
  arguments (``fn`` not callable, arguments ``fn`` cannot take, what ``fn.check_arguments``, if it
  has one, refuses: a fault's unknown mode) fail here, before any process starts.
* Processes come from a *forkserver* that has already imported torch, so after the first launch
  starting a rank costs a fork, not a Python start-up plus ``import torch``. Fork is taken from the
  server, never from the caller, so a caller that has initialised CUDA is safe. Each launch hands the
  ranks the caller's environment as it is *now* (``NCCL_DEBUG`` set after a first launch counts).
* The ranks meet through a file (``torch.distributed.FileStore`` in the run's log folder), not a
  TCP store: on the machines the course is tested on, about one ``TCPStore`` client connection in
  twenty-five stalled 5 s (so one launch in fifteen of 4 ranks took 5.1 s instead of 0.15 s), with
  the store in the caller or in rank 0, libuv or not, while plain sockets never did; a file needs
  no connection. All ranks of a launch are on this machine, so a file serves them all. The
  backend is chosen for you: NCCL only when each rank gets a GPU of its own, gloo otherwise.
* Each rank's output, down to the file descriptors (C++ warnings, gloo and NCCL messages,
  subprocesses), goes to a log file; the caller prints it after the run, rank by rank. While a run
  lasts, the caller prints a progress line every few seconds (which ranks still run, and the last
  line the first of them printed), so that work and a hang look different.
* Failures surface in the caller as one error that names the root cause, the rank that failed first
  or was killed, with the others listed as consequences, the last lines of every rank's output and
  the paths of the full logs (see ``ranklog``). A run that exceeds ``timeout`` raises
  ``LaunchTimeout`` showing where each unfinished rank was waiting (its Python stack).
* No process outlives the call, nor the caller: each rank leads a process group of its own, ended
  with the call, so what a rank started (a ``subprocess``, a ``sleep``) ends with it too; when the
  caller dies, even by SIGKILL, the kernel tells the forkserver, which ends every rank's group
  (``forkserver_guard``: no rank needs its Python thread for it, so a rank busy in C code holding
  the GIL ends as promptly as an idle one).
* Two launches at once, from one user or from two users of a shared machine, share nothing: each
  has its own folder for logs, stacks and the file store (``ranklog.RunLogs``, under the user's own
  build folder, ``infra.paths``), its own forkserver (its socket, mode 0600, is in a temporary
  folder of the caller's own, mode 0700: ``multiprocessing.util.get_temp_dir``) and its own
  MASTER_PORT, which the caller holds for the whole launch (``ports.reserve_port``). A ``master_port=``
  already in use, say by another user's launch, is replaced by a free one, and a line says so.
* Each launch notes when it ends each of its phases (asking the forkserver for the ranks, their
  start, the rendezvous, ``fn``, the closing, the results, the ranks' exit, the logs), in the
  caller and in every rank: ``last_phases()`` says where a slow launch spent its time
  (``phases``; ``python -m d2lpar bench launch`` prints it for every slow launch).
* The group is closed with a barrier before ``destroy_process_group`` (without it, gloo ranks
  sometimes abort at exit). A rank whose ``fn`` closed the group itself while the others still
  needed it is named as the cause (``ranklog.root_cause``), not the ranks its leaving stranded.

Platforms. Linux is what the course tests. macOS gets the same forkserver, output capture, stacks
at a timeout and caller watch, but no parent-death signal (``prctl`` is Linux-only; the watch thread
covers it). Windows has no fork: ranks start with ``spawn`` (each imports torch, a few seconds a
launch) and there is no signal to ask a rank for its stack, so a timeout cannot say where ranks waited.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import textwrap
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import cloudpickle
import torch

from d2lpar.processes import rank as _rank
from d2lpar.processes import ranklog
from d2lpar.processes.commands import launcher_free_env
from d2lpar.processes.phases import Phases
from d2lpar.processes.pickling import dumps
from d2lpar.processes.ports import reserve_port
from d2lpar.processes.ranklog import LaunchError, LaunchTimeout, RankFailed

__all__ = ["launch", "choose_backend", "last_phases", "LaunchError", "RankFailed", "LaunchTimeout"]


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


# ---------------------------------------------------------------------------------------- launcher

_context = None


def _forkserver():
    """The multiprocessing context; its server imports torch once, then forks ranks from there."""
    global _context
    if _context is None:
        if "forkserver" in mp.get_all_start_methods():
            _context = mp.get_context("forkserver")
            # the launcher imports the rank side; a worker from a module that imports the
            # launcher (the benches, the course's modules) then finds it already loaded.
            # torch._dynamo: the first torch.optim optimizer or DDP built in a process imports
            # torch's compiler, 2 s of CPU per rank per launch on 2 cores; once here, 2 s in all.
            # forkserver_guard: the forkserver ends, and ends its ranks' groups, with the caller.
            _context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                             "cloudpickle", "d2lpar.processes.launch",
                                             "d2lpar.processes.forkserver_guard"])
        else:  # Windows: no fork at all, so each rank starts Python and imports torch
            _context = mp.get_context("spawn")
    return _context


def _stop(procs) -> None:
    """End the ranks, then whatever they started: each rank leads a process group of its own."""
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
    if hasattr(os, "killpg"):
        for p in procs:   # a subprocess or a `sleep` a rank started, still running without it
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)


def _check_arguments(fn, world_size, timeout, env, args, kwargs, threads_per_rank=1,
                     master_port=0) -> None:
    """Refuse, in the caller and before any process starts, what would only fail in the ranks."""
    if not callable(fn):
        raise LaunchError(f"fn must be the function each rank runs, got {type(fn).__name__} "
                          f"{fn!r:.60}: pass the function itself, e.g. launch(worker, 2, x), "
                          "not launch(worker(x), 2)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise LaunchError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
            or timeout <= 0):
        raise LaunchError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) or threads_per_rank < 1:
        raise LaunchError(f"threads_per_rank must be a whole number >= 1 (torch threads per rank), "
                          f"got {threads_per_rank!r}")
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not 0 <= master_port <= 65535:
        raise LaunchError(f"master_port must be a port number from 0 to 65535 (0: a free one), "
                          f"got {master_port!r}")
    if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise LaunchError("env must map names to strings, e.g. env={'NCCL_DEBUG': 'INFO'}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: the ranks will find out
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        name = getattr(fn, "__qualname__", repr(fn))
        said = f"{name}{sig} cannot take the arguments given to launch(): {e}."
        options = [p.name for p in inspect.signature(launch).parameters.values()
                   if p.kind is p.KEYWORD_ONLY]
        clash = [p for p in sig.parameters if p in options and f"'{p}'" in str(e)]
        if clash:
            said += (f" `{clash[0]}` is also an option of launch(): `{clash[0]}=` given to launch() "
                     f"is the launcher's, not {name}'s. Pass {name}'s positionally or with "
                     f"fn_kwargs={{'{clash[0]}': ...}}.")
        raise LaunchError(said + " Nothing was started.") from None
    check = getattr(fn, "check_arguments", None)
    if callable(check):   # fn's own check (a fault's mode, say): once here, not in every rank
        check(*args, **kwargs)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "auto",
           timeout: float = 120.0, threads_per_rank: int = 1, capture_output: bool = True,
           quiet: bool = False, init_process_group: bool = True, master_addr: str = "127.0.0.1",
           master_port: int = 0, env: dict[str, str] | None = None,
           fn_kwargs: dict[str, Any] | None = None, progress: float | None = 3.0,
           **kwargs: Any) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the list of their return values.

    backend: 'auto' (NCCL with one GPU per rank, else gloo), 'gloo' or 'nccl'.
    timeout: seconds for the whole run; then the unfinished ranks' stacks are taken and every rank
        is stopped (collectives get a few seconds more, so the launcher's timeout speaks first).
    threads_per_rank: torch compute threads per rank (1 keeps simulated ranks from fighting for cores).
    capture_output: capture each rank's output (file descriptors 1 and 2) and print it after the
        run, prefixed and in rank order (False lets ranks write to the terminal as they go,
        interleaved, and errors then cannot quote it).
    quiet: with capture_output, discard what the ranks print instead.
    init_process_group: False leaves the call to ``dist.init_process_group()`` to ``fn``, with
        MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK set for ``init_method='env://'``.
    master_addr, master_port: MASTER_ADDR and MASTER_PORT for the ranks; port 0 (the default) is a
        free one; a port in use is replaced by a free one (a line says so).
    env: variables set in the ranks on top of the caller's environment (which they get as it is now).
    fn_kwargs: keyword arguments for ``fn`` whose names are also options of launch (``timeout``...).
    progress: seconds after which, and then every ``PROGRESS_EVERY`` seconds, a line says which ranks
        still run and what the first of them printed last (None: no progress lines).
    """
    phases = Phases()
    phases.mark("called")
    _last.phases = phases
    fn_kwargs = dict(fn_kwargs or {})
    if set(fn_kwargs) & set(kwargs):
        raise LaunchError(f"{sorted(set(fn_kwargs) & set(kwargs))} given both as keywords and in "
                          "fn_kwargs: give each once")
    kwargs.update(fn_kwargs)
    _check_arguments(fn, world_size, timeout, env, args, kwargs, threads_per_rank, master_port)
    held, port = reserve_port(master_addr, master_port)
    try:
        chosen, reason = choose_backend(world_size, backend)
        if backend == "auto" and (chosen, reason) not in _said:
            _said.add((chosen, reason))
            print(f"launch: backend {chosen} ({reason})")
        try:
            payload = dumps((fn, args, kwargs))
        except Exception as e:
            raise LaunchError(f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to "
                              f"the ranks: {type(e).__name__}: {e}. Pass only picklable values "
                              "(tensors, numbers, modules); create locks, files and sockets inside "
                              "the worker") from e
        rank_env = launcher_free_env({
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": str(threads_per_rank),
            **(env or {})})
        return _run(payload, world_size, chosen, rank_env, timeout, threads_per_rank,
                    capture_output, quiet, init_process_group, progress, phases)
    finally:
        if held is not None:
            held.close()


def _run(payload: bytes, world_size: int, chosen: str, rank_env: dict, timeout: float,
         threads_per_rank: int, capture_output: bool, quiet: bool, init_process_group: bool,
         progress: float | None, phases: Phases) -> list[Any]:
    """Start the ranks from the forkserver, collect their results, print their output."""
    ctx = _forkserver()
    group_timeout = timeout + 10  # the launcher's deadline comes first, and takes the stacks
    logs = ranklog.RunLogs(world_size)   # this launch's own folder: logs, stacks, the file store
    procs, readers, done = [], [], False
    phases.mark("forking")
    try:
        with _rank.main_not_rerun():
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_rank.main, name=f"d2lpar-rank{rank}", args=(
                    rank, world_size, payload, writer, rank_env, chosen, threads_per_rank,
                    group_timeout, str(logs.log(rank)), str(logs.stack(rank)), capture_output,
                    str(logs.dir / "rendezvous") if init_process_group else None))
                procs.append(p)
                readers.append(reader)
                p.start()
                writer.close()
        phases.mark("forked")
        results = _collect(procs, readers, world_size, timeout, logs, capture_output, progress,
                           phases)
        done = True
    finally:
        _stop(procs)
        phases.mark("stopped")
        for r in readers:
            r.close()
        if not done:
            logs.keep()
    outputs = [logs.output(rank) for rank in range(world_size)]
    logs.remove()
    if capture_output and not quiet:
        for rank, text in enumerate(outputs):
            for line in text.rstrip("\n").splitlines():
                print(f"[rank {rank}] {line}")
    phases.mark("done")
    return results


_last = threading.local()


def last_phases() -> Phases | None:
    """The phases (``d2lpar.processes.phases``) of the last launch this thread made, or None."""
    return getattr(_last, "phases", None)


def _receive(proc, reader, obj) -> tuple:
    """The rank's message, or ("died", how, when) if it ended without one."""
    if obj is not reader and not reader.poll():  # it ended: a message may still be on its way
        proc.join(0.5)
        reader.poll(0.5)
    if reader.poll():
        try:
            return reader.recv()
        except (EOFError, OSError):
            pass
    proc.join(1.0)
    code = proc.exitcode
    why = (f"was killed by signal {signal.Signals(-code).name}" if code and code < 0
           else f"exited with code {code}")
    return ("died", f"the process {why} before returning a result", time.time())


PROGRESS_EVERY = 5.0   # seconds between two progress lines, after the first


def progress_line(elapsed: float, pending: set[int], world_size: int, last: str) -> str:
    """``launch: still running after 6 s: rank(s) 0, 1 of 4``, and on a second line what the
    first of them last printed, shortened at a word (each line within 100 characters)."""
    ranks = ", ".join(str(r) for r in sorted(pending))
    line = f"launch: still running after {elapsed:.0f} s: rank(s) {ranks} of {world_size}"
    if not last:
        return line
    head = f"  rank {min(pending)} last printed: "
    return line + "\n" + head + textwrap.shorten(last, 100 - len(head), placeholder=" ...")


def _last_line(logs, rank: int) -> str:
    lines = [ln.strip() for ln in logs.output(rank).splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _collect(procs, readers, world_size: int, timeout: float, logs, captured: bool,
             progress: float | None = None, phases: Phases | None = None) -> list[Any]:
    """Wait for every rank's message; raise once the failures are in, or at the deadline."""
    start = time.monotonic()
    deadline = start + timeout
    tick = start + progress if progress is not None else float("inf")
    results: list[Any] = [None] * world_size
    failures: list[ranklog.Failure] = []
    left: list[int] = []   # ranks whose fn closed the launcher's process group itself
    pending = set(range(world_size))
    first_failure = None
    while pending:
        end = deadline
        if first_failure is not None:  # the others get a moment to report; more if no cause yet
            known_cause = any(not f.consequence for f in failures)
            end = min(deadline, first_failure + (0.5 if known_cause else 2.0))
        now = time.monotonic()
        if now >= end:
            break
        if now >= tick and first_failure is None:
            last = _last_line(logs, min(pending)) if captured else ""
            print(progress_line(now - start, pending, world_size, last), flush=True)
            tick = now + PROGRESS_EVERY
        waitables = {readers[r]: r for r in pending}
        waitables.update({procs[r].sentinel: r for r in pending})
        for obj in mp.connection.wait(list(waitables), timeout=max(0.0, min(end, tick) - now)):
            rank = waitables[obj]
            if rank not in pending:
                continue
            msg = _receive(procs[rank], readers[rank], obj)
            if isinstance(msg[-1], dict):   # the rank's phase marks (rank.main sends them last)
                msg, marks = msg[:-1], msg[-1]
                if phases is not None:
                    phases.ranks[rank] = marks
            if phases is not None:
                phases.received[rank] = time.time()
            pending.discard(rank)
            if msg[0] == "ok":
                results[rank] = cloudpickle.loads(msg[1])
                if ranklog.LEFT_GROUP in msg[2:]:
                    left.append(rank)
            else:
                failures.append(ranklog.Failure(rank, msg[0], msg[1], msg[2]))
                first_failure = first_failure or time.monotonic()
    details = logs.tails() if captured else "(output went to the terminal: capture_output=False)"
    if failures:
        cause, others = ranklog.root_cause(failures, left)
        consequences = {f.rank: f.last_line for f in others}
        stacks = _stacks(procs, sorted(pending), logs)
        consequences.update({r: f"was still running and {ranklog.where(stacks[r])}; the launcher "
                                "stopped it" for r in pending})
        text = cause.text
        if cause.kind == "died" and captured:
            text = ranklog.explain_death(text, logs.output(cause.rank))
        raise RankFailed(cause.rank, world_size, text, ranklog.printed(logs.output(cause.rank)),
                         consequences, logs.dir, details)
    if pending:
        stacks = _stacks(procs, sorted(pending), logs)
        where = "\n".join(f"  rank {r} {ranklog.where(s)}\n{ranklog.stack_lines(s)}"
                          for r, s in stacks.items())
        raise LaunchTimeout(
            f"ranks {sorted(pending)} of {world_size} had not finished after {timeout:g} s and were "
            "stopped. A rank waiting in a collective that another rank never reaches hangs like "
            "this; raise timeout= if the work is just slow.\n\nWhere each unfinished rank was "
            f"waiting (most recent call last):\n{where}\n\n{details}",
            sorted(pending), stacks, logs.dir)
    return results


def _stacks(procs, ranks, logs) -> dict[int, str]:
    """Ask each rank in ``ranks`` for its Python stack (faulthandler, on a signal) and read it."""
    if ranklog.STACK_SIGNAL is None:
        return {r: "" for r in ranks}
    for r in ranks:
        with contextlib.suppress(OSError):
            os.kill(procs[r].pid, ranklog.STACK_SIGNAL)
    logs.wait_for_stacks(ranks)
    return {r: logs.stack_text(r) for r in ranks}
