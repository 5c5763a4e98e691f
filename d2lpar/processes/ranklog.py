"""What went wrong in a launch: each rank's full output, where each rank waited, which rank began it.

When one of N ranks fails, the others usually fail too, a moment later and for a different reason:
they were waiting for the rank that left, and their connection closed. Reporting whichever error
arrived first then blames an innocent rank. Three pieces of evidence tell the story instead:

* **Output, at the file-descriptor level.** Each rank's file descriptors 1 and 2 point at its own
  log file, ``<build>/launch/<run>/rank<r>.log``, so the log holds what Python prints *and* what C++
  (gloo, NCCL), the C library and subprocesses write. The caller replays it in rank order after a
  good run (and deletes it); after a failure it quotes the last lines and keeps the file.
* **Where a rank waits.** Each rank arms ``faulthandler`` on a signal (SIGUSR1). At a timeout the
  caller sends it before stopping the ranks, and each unfinished rank writes its Python stack to
  ``rank<r>.stack``: "rank 1 was in all_reduce, called from worker (line 4)".
* **The root cause.** Each failure is ``(consequence, time)``: a rank killed by a signal or raising
  its own error is a *cause* (``consequence = 0``); a rank whose error says a peer went away
  (connection closed or reset, broken pipe) is a *consequence* (``consequence = 1``). The reported
  rank is ``min`` over failures of ``(consequence, time)``: the earliest cause, whatever the order in
  which the messages reached the caller.

The launcher's errors live here too (``launch`` exports them): ``RankFailed`` (the cause's traceback,
the consequences, every rank's last ``TAIL_LINES`` lines, the log folder) and ``LaunchTimeout``
(where each unfinished rank waited). A good run's logs are deleted; a failed run's are kept, the
newest ``KEEP_RUNS`` of the user's. Each launch has a folder of its own, made with a new name, so
launches at once (two kernels, two users sharing a build folder) never write into one.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from d2lpar.infra.paths import build_dir

__all__ = ["LaunchError", "RankFailed", "LaunchTimeout", "RunLogs", "Failure", "root_cause", "where",
           "printed", "stack_lines", "tidy", "RAISED_MARK", "STACK_SIGNAL", "TAIL_LINES"]

TAIL_LINES = 20   # lines of each rank's output quoted in an error
KEEP_RUNS = 20    # logs of failed runs kept under <build>/launch; older ones are deleted
STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # None on Windows: no stacks at a timeout there

# What a rank's error says when a *peer* went away (gloo, NCCL, the TCP store): a consequence.
PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
                       r"EPIPE|Socket closed|remote process exited|peer (?:has )?(?:closed|exited)|"
                       r"communicator was aborted|Connection refused", re.IGNORECASE)
RAISED_MARK = "[launch] this rank raised:"  # in a log: what the rank printed ends here
FN_RETURNED = "fn returned"  # in a stack file: the rank waits in the launcher's closing barrier
LEFT_GROUP = "left the group"  # after "ok" in a rank's message: its fn closed the launcher's group
_runs = 0


class LaunchError(RuntimeError):
    """The ranks could not be started, or did not finish."""


MAX_CHARS = 6000       # at most this many characters of one text (traceback, output) in an error
MAX_LINE = 400         # and of one line of a rank's output


def clip(text: str, limit: int = MAX_CHARS, where: str = "the rank's log") -> str:
    """``text`` cut to about ``limit`` characters (its start and its end), saying how much was cut."""
    if len(text) <= limit:
        return text
    head, tail = text[: limit // 3], text[-(limit - limit // 3):]
    return f"{head}\n[... {len(text) - limit:,} characters cut: the whole text is in {where} ...]\n{tail}"


class RankFailed(LaunchError):
    """A rank raised an exception or died.

    ``.rank`` names the root cause, ``.remote_traceback`` is its traceback (or how it died),
    ``.output`` its output, ``.consequences`` the other ranks' failures (rank -> last line), and
    ``.logs`` the folder holding every rank's full output.
    """

    def __init__(self, rank: int, world_size: int, remote_traceback: str, output: str = "",
                 consequences: dict[int, str] | None = None, logs=None, detail: str = ""):
        self.rank, self.world_size = rank, world_size
        self.remote_traceback, self.output = remote_traceback, output
        self.consequences, self.logs = dict(consequences or {}), logs
        text = f"rank {rank} of {world_size} failed:\n\n{clip(remote_traceback.rstrip())}"
        if self.consequences:
            text += "\n\nThen, as a consequence:" + "".join(
                f"\n  rank {r}: {clip(why, MAX_LINE)}" for r, why in sorted(self.consequences.items()))
        if detail:
            text += "\n\n" + detail
        elif output.strip():
            text += f"\n\nrank {rank} printed:\n{clip(output.rstrip())}"
        super().__init__(text)


class LaunchTimeout(LaunchError):
    """Some ranks had not finished when the timeout ran out; they were stopped.

    ``.ranks`` lists them, ``.stacks`` maps each to its Python stack (faulthandler's dump, taken
    just before the stop), ``.logs`` is the folder holding every rank's full output.
    """

    def __init__(self, message: str, ranks=(), stacks: dict[int, str] | None = None, logs=None):
        self.ranks, self.stacks, self.logs = list(ranks), dict(stacks or {}), logs
        super().__init__(message)


# ------------------------------------------------------------------------------- in the caller

class RunLogs:
    """The folder of one launch: ``rank<r>.log`` (output) and ``rank<r>.stack`` (stack at a timeout)."""

    def __init__(self, world_size: int):
        global _runs
        _runs += 1
        self.world_size = world_size
        # made here, and only here (mkdtemp: a new name, mode 0700), so that launches sharing a
        # build folder (two kernels; processes whose pids repeat in containers) never share one
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{_runs:04d}-"
        self.dir = Path(tempfile.mkdtemp(prefix=stamp, dir=build_dir("launch")))

    def log(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.log"

    def stack(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.stack"

    def output(self, rank: int) -> str:
        try:
            return self.log(rank).read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, rank: int, n: int = TAIL_LINES) -> str:
        lines = printed(self.output(rank)).rstrip("\n").splitlines()
        return "\n".join(clip(line, MAX_LINE, str(self.log(rank))) for line in lines[-n:]) if lines else ""

    def stack_text(self, rank: int) -> str:
        try:
            return self.stack(rank).read_text(errors="replace")
        except OSError:
            return ""

    def wait_for_stacks(self, ranks, timeout: float = 1.0) -> None:
        """Wait (briefly) until each rank in ``ranks`` has written its stack after the signal."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("most recent call first" in self.stack_text(r) for r in ranks):
                return
            time.sleep(0.02)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def keep(self) -> None:
        """Keep this run's logs; of this user's runs' folders, delete all but the newest KEEP_RUNS
        (another user's, in a build folder they share, are theirs to delete)."""
        runs = []
        for folder in self.dir.parent.iterdir():
            try:
                st = folder.stat()
            except OSError:   # deleted meanwhile, by another launch's keep()
                continue
            if not hasattr(os, "getuid") or st.st_uid == os.getuid():
                runs.append((st.st_mtime, folder.name, folder))
        for _, _, old in sorted(runs)[:-KEEP_RUNS]:
            if old != self.dir:
                shutil.rmtree(old, ignore_errors=True)

    def tails(self, ranks=None) -> str:
        """The last lines of each rank's output, each headed by the path of its full log."""
        parts = [f"Last lines of each rank's output (full logs in {self.dir}):"]
        for r in range(self.world_size) if ranks is None else ranks:
            text = self.tail(r)
            body = "\n".join("    " + line for line in text.splitlines()) if text else "    (nothing)"
            parts.append(f"  rank {r} ({self.log(r).name}):\n{body}")
        return "\n".join(parts)


@dataclass(frozen=True)
class Failure:
    """One rank's failure: it ``raised`` (``text`` is its traceback) or ``died`` (``text`` says how)."""
    rank: int
    kind: str      # "raised" or "died"
    text: str
    time: float    # when it raised (the rank's clock) or was seen dead (the caller's); same machine

    @property
    def consequence(self) -> int:
        """1 when the error says a peer went away (it follows another rank's failure), else 0."""
        return int(self.kind == "raised" and bool(PEER_GONE.search(self.last_line)))

    @property
    def last_line(self) -> str:
        lines = [line for line in self.text.strip().splitlines() if line.strip()]
        return tidy(lines[-1] if lines else self.text)


# What gloo prints before it aborts the process over a collective whose ranks disagree.
_GLOO_MISMATCH = re.compile(r"Received data size doesn't match expected size|collective mismatch"
                            r"|op\.preamble\.length")


def explain_death(text: str, output: str) -> str:
    """``text`` (how a rank died), with the reason when its output shows gloo aborting over a mismatch."""
    if not _GLOO_MISMATCH.search(output):
        return text
    return (f"{text}: gloo aborted it because the ranks called one collective with tensors of "
            "different sizes or dtypes, or called different collectives at that point (gloo's own "
            "words are in its output below). Print each rank's tensor shape and dtype just before "
            "its collectives to see which differ")


def root_cause(failures: list[Failure], left=()) -> tuple[Failure, list[Failure]]:
    """The failure that began it, ``min((consequence, time))``, and the others in rank order.

    ``left``: ranks whose fn returned after closing the launcher's process group itself. When every
    failure is a consequence (a peer went away), those ranks began it: they left a group the others
    still needed, if only for the launcher's closing barrier."""
    if left and all(f.consequence for f in failures):
        return _left_early(sorted(left), failures), sorted(failures, key=lambda f: f.rank)
    cause = min(failures, key=lambda f: (f.consequence, f.time, f.rank))
    return cause, sorted((f for f in failures if f is not cause), key=lambda f: f.rank)


def _left_early(left: list[int], failures: list[Failure]) -> Failure:
    """The cause when ranks ``left`` closed the group and the ``failures`` lost their peer."""
    ranks, one = ", ".join(map(str, left)), len(left) == 1
    stranded = ", ".join(str(f.rank) for f in sorted(failures, key=lambda f: f.rank))
    text = (f"rank{'' if one else 's'} {ranks} left the process group early "
            f"({'its' if one else 'their'} fn called dist.destroy_process_group() and "
            f"returned) while rank(s) {stranded} still "
            "needed it, in their fn or in the launcher's closing barrier: call "
            "destroy_process_group() in every rank after its last collective, or in none (the "
            "launcher closes the group once fn returns)")
    return Failure(left[0], "left", text, min(f.time for f in failures))


_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_LIBRARY = ("/torch/", "/multiprocessing/", "/cloudpickle/", "/threading.py", "/d2lpar/processes/")


def _at(path: str, line: int) -> str:
    """``file line N``, with library paths shortened; IPython's file for a cell is a notebook cell."""
    if re.search(r"ipykernel_\d+[/\\]\d+\.py$", path):
        return f"notebook cell, line {line}"
    return f"{_short(path)} line {line}"


_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2]) + os.sep  # the folder holding d2lpar


def _short(path: str) -> str:
    """Library and course paths without this machine's prefix: ``torch/...``, ``d2lpar/...``."""
    for marker in ("site-packages/", "lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1].lstrip("0123456789./")
    if path.startswith(_PACKAGE_PARENT):
        return path[len(_PACKAGE_PARENT):]
    return path


def main_thread_stack(text: str) -> list[tuple[str, int, str]]:
    """The frames ``(file, line, function)`` of the rank's main thread, innermost first."""
    ident = re.search(r"^# main thread (0x[0-9a-f]+)", text, re.MULTILINE)
    blocks = re.split(r"^(?=(?:Current thread|Thread) 0x)", text, flags=re.MULTILINE)
    blocks = [b for b in blocks if "most recent call first" in b.split("\n", 1)[0]]
    chosen = [b for b in blocks if ident and ident.group(1) in b.split("\n", 1)[0]]
    block = chosen[0] if chosen else "".join(blocks[-1:])
    return [(m["file"], int(m["line"]), m["func"]) for m in map(_FRAME.match, block.splitlines()) if m]


def where(text: str) -> str:
    """One phrase from a faulthandler dump: the innermost frame and, if apart, the calling code."""
    frames = main_thread_stack(text)
    if not frames:
        if STACK_SIGNAL is None:
            return "gave no stack (this platform has no SIGUSR1 to ask for one)"
        return "gave no stack (it did not answer the signal)"
    file, line, func = frames[0]
    said = f"was in {func} ({_at(file, line)})"
    mine = next((f for f in frames if not any(lib in f[0] for lib in _LIBRARY)  # and not the
                 and not f[0].startswith("<")), None)  # forkserver's <string>: no file to read
    if mine and mine != frames[0]:
        said += f", called from {mine[2]} ({_at(mine[0], mine[1])})"
    if f"# {FN_RETURNED}" in text:
        said += ": its fn had returned, it waited for the others in the launcher's closing barrier"
    return said


def stack_lines(text: str) -> str:
    """The main thread's stack from the rank's code inwards, as ``file:line in function`` lines."""
    frames = list(reversed(main_thread_stack(text)))
    start = max((i + 1 for i, f in enumerate(frames) if "/d2lpar/processes/rank.py" in f[0]), default=0)
    return "\n".join(f"      {_at(f, n)} in {fn}" for f, n, fn in frames[start:] or frames)


def tidy(line: str) -> str:
    """An error line without the library's source location and sign-off (gloo's "GLHF!")."""
    line = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", line)
    return re.sub(r"\s*GLHF!.*$", "", line).strip()


def printed(log: str) -> str:
    """What the rank printed: its log without the traceback the launcher appended."""
    return log.split(RAISED_MARK, 1)[0]
