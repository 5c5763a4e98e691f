"""Run a launcher command (torchrun, srun-like set-ups) with a deadline, and leave no process behind.

A launcher is a tree of processes: ``torchrun`` starts one worker per rank, and its workers call
``setsid``, so they leave the launcher's process group; killing the group, or the launcher, can leave
workers running. Every command started here gets a random tag in its environment
(``D2LPAR_RUN_TAG``); children inherit their parent's environment, so the tag marks the whole tree,
and ``stop()`` kills exactly the processes that carry it (found through ``/proc`` on Linux; elsewhere
the process group is killed). The same tag lets a test find "the worker with RANK=1" and kill it.

Platforms: ``/proc`` and process groups are Linux (and, for groups, POSIX) features. Without
``/proc`` (macOS, Windows) tagged processes cannot be found, so ``stop()`` kills the command and its
process group only, ``leftovers()`` and ``pids()`` return ``[]``, and each says so once in a warning.

Output (stdout and stderr merged) is collected line by line while the command runs. ``text()`` gives it
back with machine paths (the Python executable, the checkout, the temporary folder) replaced by short
names, and ``pretty(cmd)`` prints a command the way a reader would type it in ``working_folder()``:
the checkout's root when this process runs inside the checkout d2lpar comes from, else the current
folder. A path in a printed command is real there: relative inside that folder, ``~/...`` inside the
home folder, else absolute (``typed_path``); so a command the course runs from that folder is
exactly the one it prints.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Callable, Mapping, Sequence

__all__ = ["CommandFailed", "Running", "descendants", "free_port", "is_alive", "launcher_free_env",
           "leftovers", "open_fds", "pretty", "run", "start", "REPO", "HAVE_PROC", "checkout",
           "typed_path", "working_folder"]

REPO = Path(__file__).resolve().parents[2]  # the folder that holds the d2lpar package
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "MASTER_ADDR", "MASTER_PORT")
TAG = "D2LPAR_RUN_TAG"
_started: set[str] = set()  # the tags of every command this process started
HAVE_PROC = os.path.isdir("/proc")  # Linux; macOS and Windows have no /proc
_warned: set[str] = set()


def _without_proc(what: str) -> None:
    """Say once, in one sentence, what this platform cannot do without /proc."""
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"d2lpar.processes.commands: this platform has no /proc, so {what}",
                      RuntimeWarning, stacklevel=3)


class CommandFailed(RuntimeError):
    """The command exited with an error or ran past its timeout."""


def free_port(addr: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (good enough for a launcher started right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def launcher_free_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher variables (RANK, SLURM_*, ...), one thread each."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS
           and not k.startswith(("SLURM_", "TORCHELASTIC_", "PET_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def checkout() -> Path | None:
    """The repository checkout d2lpar is imported from (its pyproject.toml sits beside the
    package), or None where d2lpar is installed (a wheel in site-packages)."""
    return REPO if (REPO / "pyproject.toml").is_file() else None


def working_folder() -> Path:
    """Where the course's printed commands are typed and run: the checkout's root when the current
    folder is inside the checkout d2lpar comes from (the README's commands are typed there, and
    ``build/`` is there), else the current folder (a notebook copied anywhere)."""
    here, root = Path.cwd().resolve(), checkout()
    return root if root is not None and (here == root or root in here.parents) else here


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def typed_path(path: str | os.PathLike, folder: str | os.PathLike | None = None,
               tilde: bool = True) -> str:
    """``path`` as a reader types it in ``folder`` (``working_folder()`` by default): relative
    inside ``folder``, ``~/...`` inside the home folder (with ``tilde``), else absolute. A
    relative ``path`` is taken as relative to ``folder``."""
    base = Path(folder).resolve() if folder is not None else working_folder()
    full = (base / path).resolve()
    if _inside(full, base):
        return full.relative_to(base).as_posix() if full != base else "."
    home = Path(os.path.expanduser("~")).resolve()
    if tilde and home != Path(home.anchor) and _inside(full, home):
        return "~" if full == home else "~/" + full.relative_to(home).as_posix()
    return str(full)


def _typed_word(word: str, folder: Path) -> str:
    """One word of a command as typed in ``folder``, quoted for a POSIX shell."""
    if word == sys.executable:
        return "python"
    if os.path.isabs(word) and Path(word).parent == Path(sys.executable).parent:
        return shlex.quote(Path(word).name)  # a program of this Python's bin folder: on the PATH
    if os.path.isabs(word):
        typed = typed_path(word, folder)
        if typed.startswith("~/"):  # unquoted: the shell expands ~ only there
            return "~/" + shlex.quote(typed[2:])
        return shlex.quote(typed)
    key, eq, value = word.partition("=")
    if eq and key.startswith("-") and os.path.isabs(value):  # --out=/a/b: no ~ after '='
        return shlex.quote(f"{key}={typed_path(value, folder, tilde=False)}")
    return shlex.quote(word)


def _replacements() -> list[tuple[str, str]]:
    pairs = [(sys.executable, "python"), (str(Path(sys.executable).parent) + os.sep, ""),
             (str(REPO) + os.sep, ""), (str(REPO), "."),
             (tempfile.gettempdir() + os.sep, "")]
    build = os.environ.get("D2LPAR_BUILD_DIR")
    if build and REPO not in Path(build).resolve().parents:  # inside the checkout: keep build/...
        pairs.insert(0, (str(Path(build).resolve()) + os.sep, ""))
    return pairs


def sanitize(text: str, cwd: str | os.PathLike | None = None) -> str:
    """Replace machine paths in ``text`` by short relative names."""
    pairs = ([(str(Path(cwd).resolve()) + os.sep, "")] if cwd else []) + _replacements()
    for old, new in pairs:
        text = text.replace(old, new)
    return text


def pretty(cmd: Sequence[str], env: Mapping[str, str] | None = None, cwd=None) -> str:
    """The command as a reader types it in ``cwd`` (``working_folder()`` by default): ``python``
    for this Python, ``torchrun`` for ``python -m torch.distributed.run``, paths by ``typed_path``."""
    folder = Path(cwd).resolve() if cwd is not None else working_folder()
    words = [_typed_word(str(w), folder) for w in cmd]
    if words[:3] == ["python", "-m", "torch.distributed.run"]:
        words = ["torchrun"] + words[3:]
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + " ".join(words)


def _tagged(*tags: str) -> list[int]:
    pids = []
    if not tags:
        return pids
    if not HAVE_PROC:
        _without_proc("processes that a command started in a session of their own cannot be found "
                      "(only the command and its process group are stopped)")
        return pids
    needles = {f"{TAG}={tag}".encode() for tag in tags}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needles.intersection(f.read().split(b"\0")):
                    pids.append(int(name))
        except OSError:
            continue
    return pids


def leftovers() -> list[int]:
    """Processes still alive from any command this process started (Linux; [] elsewhere)."""
    return [pid for pid in _tagged(*_started) if is_alive(pid)]


def is_alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped, does not count)."""
    if not HAVE_PROC:
        if os.name != "posix":  # on Windows os.kill(pid, 0) would terminate the process
            _without_proc("is_alive() cannot tell whether a process runs, and answers True")
            return True
        try:
            os.kill(pid, 0)  # a zombie counts as alive here
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int | None = None) -> set[int] | None:
    """Live (non-zombie) descendants of ``pid`` (default: this process); None without /proc."""
    if not HAVE_PROC:
        return None
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(name)] = int(fields[1])
    kids, frontier = set(), {os.getpid() if pid is None else pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - kids
        kids |= frontier
    return kids


def open_fds() -> int | None:
    """How many file descriptors this process has open; None where the platform cannot say."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(folder):
            return len(os.listdir(folder)) - 1  # listing the folder opens one
    return None


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


class Running:
    """A started command: its output so far, its processes, and a way to stop all of them."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], cwd=None):
        self.cmd, self.cwd, self.tag = [str(c) for c in cmd], cwd, uuid.uuid4().hex
        _started.add(self.tag)
        self.lines: list[str] = []
        self.returncode: int | None = None
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env={**env, TAG: self.tag}, cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def pids(self, **match: str) -> list[int]:
        """Live processes of this command whose environment has all of ``match`` (e.g. RANK='1')."""
        return [p for p in _tagged(self.tag)
                if all(_environ(p).get(k) == str(v) for k, v in match.items())]

    def wait_until(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Poll ``ready()`` until it holds (True) or the command ends or time runs out (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return True
            if self.proc.poll() is not None:
                return bool(ready())
            time.sleep(0.01)
        return False

    def wait(self, timeout: float) -> int | None:
        """Wait for the command; None if it is still running after ``timeout`` seconds."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(5)
        self.returncode = code
        return code

    def stop(self) -> None:
        """Kill every process of this command (idempotent)."""
        for _ in range(3):
            pids = _tagged(self.tag)
            try:  # the session we started: the command and whatever stayed in its group
                if hasattr(os, "killpg"):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:  # Windows: no process groups to kill, only the command itself
                    self.proc.kill()
            except OSError:
                pass
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)  # pids come from /proc: Linux only
                except OSError:
                    pass
            time.sleep(0.05)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(5)
        if self.proc.stdout:
            self.proc.stdout.close()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def text(self) -> str:
        return sanitize("\n".join(self.lines), self.cwd)


def start(cmd: Sequence[str], env: Mapping[str, str] | None = None, cwd=None) -> Running:
    """Start ``cmd`` (environment: ``launcher_free_env(env)``); call ``.stop()`` when done."""
    return Running(cmd, launcher_free_env(env), cwd)


def run(cmd: Sequence[str], timeout: float = 60.0, env: Mapping[str, str] | None = None, cwd=None,
        check: bool = True) -> Running:
    """Run ``cmd`` to the end (at most ``timeout`` seconds), kill what is left, return it.

    With check=True an exit code other than 0, or the timeout, raises CommandFailed with the output.
    """
    job = start(cmd, env, cwd)
    try:
        code = job.wait(timeout)
    finally:
        job.stop()
    if check and code != 0:
        why = f"ran past {timeout:g} s and was killed" if code is None else f"exited with {code}"
        tail = "\n".join(job.text().splitlines()[-30:])
        raise CommandFailed(f"`{pretty(cmd, cwd=cwd)}` {why}; its last output:\n{tail}")
    return job
