"""Where one launch spent its time: its phases, in order, and the rank that held each one up.

A launch of N ranks goes through these phases; the caller and each rank note the moment (wall
clock, shared by every process of one machine) at which they end one:

==========  ====================================================================================
prepare     the caller checks the arguments, holds a port, pickles ``fn``, makes the log folder
fork        the caller asks the forkserver for each rank, one after the other, and gets its pid
start       each rank sets itself up (environment, output into its log, stack dumps) and unpickles
            ``fn``
rendezvous  ``init_process_group``: the file store, then gloo's connection between every pair
work        ``fn`` itself
close       the launcher's closing barrier and ``destroy_process_group``
results     each rank's result pickled, sent through its pipe and read by the caller
exit        the ranks end and the caller collects them (the forkserver reports each exit)
logs        the caller reads, prints and deletes the ranks' logs
==========  ====================================================================================

Ranks overlap (one may still start while another waits in the rendezvous), so a phase is counted
on the launch's critical path: phase k ends at *milestone* k, the moment the last rank (or the
caller) finished it, and never before milestone k - 1; its time is milestone k - milestone k-1.
The times add up to the launch's wall time, and the slowest phase, with the rank that finished it
last, says what held the launch up. A phase nobody noted (``init_process_group=False`` has no
rendezvous; a rank that died noted nothing) takes no time of its own.

``launch.last_phases()`` returns the ``Phases`` of the last launch made from the calling thread;
``python -m d2lpar bench launch`` prints the phases of every slow launch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["PHASES", "Phases", "phase_table"]

# (phase, who notes its end, the mark's name): "caller" marks once, "ranks" once per rank
PHASES = (("prepare", "caller", "forking"), ("fork", "caller", "forked"),
          ("start", "ranks", "ready"), ("rendezvous", "ranks", "joined"),
          ("work", "ranks", "worked"), ("close", "ranks", "closed"),
          ("results", "caller", "received"), ("exit", "caller", "stopped"),
          ("logs", "caller", "done"))
NAMES = tuple(name for name, _, _ in PHASES)


@dataclass
class Phases:
    """The marks of one launch: the caller's (``received`` per rank) and each rank's."""
    caller: dict[str, float] = field(default_factory=dict)
    received: dict[int, float] = field(default_factory=dict)
    ranks: dict[int, dict[str, float]] = field(default_factory=dict)

    def mark(self, name: str, when: float | None = None) -> None:
        self.caller[name] = time.time() if when is None else when

    def _ends(self, who: str, mark: str) -> dict[int | None, float]:
        """When each party noted ``mark``: {None: t} for the caller, {rank: t} otherwise."""
        if who == "caller" and mark == "received":
            return dict(self.received)
        if who == "caller":
            return {None: self.caller[mark]} if mark in self.caller else {}
        return {r: m[mark] for r, m in self.ranks.items() if mark in m}

    def milestones(self) -> list[tuple[str, float, int | None]]:
        """``(phase, end, last)`` in order: ``last`` is the rank that ended it last (None: the
        caller, or nobody noted it)."""
        out, t = [], self.caller.get("called", 0.0)
        for name, who, mark in PHASES:
            ends = self._ends(who, mark)
            last = max(ends, key=ends.get) if ends else None
            if ends and ends[last] > t:
                t = ends[last]
            else:   # noted by nobody, or done before the phase before it: no time of its own
                last = None
            out.append((name, t, last))
        return out

    def seconds(self) -> dict[str, float]:
        """Seconds of each phase on the critical path; they add up to ``total()``."""
        out, t = {}, self.caller.get("called", 0.0)
        for name, end, _ in self.milestones():
            out[name], t = end - t, end
        return out

    def total(self) -> float:
        return sum(self.seconds().values())

    def slowest(self) -> tuple[str, float, int | None]:
        """``(phase, seconds, last rank)`` of the phase that took the longest."""
        secs = self.seconds()
        name = max(secs, key=secs.get)
        last = next(last for n, _, last in self.milestones() if n == name)
        return name, secs[name], last

    def line(self) -> str:
        """``0.912 s, most in rendezvous: 0.780 s (rank 3 last)``, then every phase in ms."""
        name, secs, last = self.slowest()
        who = f" (rank {last} last)" if last is not None else ""
        head = f"{self.total():.3f} s, most in {name}: {secs:.3f} s{who}"
        return head + "\n    ms: " + " ".join(f"{n} {s * 1e3:.0f}" for n, s in self.seconds().items())


def phase_table(runs: list[Phases]) -> list[str]:
    """Median, 95th percentile and maximum of each phase over ``runs`` (lines of 56 characters)."""
    lines = [f"{'phase':<11} {'median':>9} {'p95':>9} {'max':>9}   (seconds)"]
    per = {name: sorted(p.seconds()[name] for p in runs) for name in NAMES}
    for name, values in per.items():
        if values:
            p95 = values[min(len(values) - 1, int(0.95 * len(values)))]
            lines.append(f"{name:<11} {values[len(values) // 2]:>9.3f} {p95:>9.3f} "
                         f"{values[-1]:>9.3f}")
    return lines
