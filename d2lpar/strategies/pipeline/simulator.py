"""Playing a pipeline schedule in pure Python: when each action runs, who waits, who holds what.

``simulate`` runs every rank's list in order, each action as soon as its rank is free and its inputs
have arrived (the actions it needs, plus a ``latency`` when they ran on another rank), with given
durations per kind and a factor per stage, and an ``overhead`` between two actions of a rank (the
bookkeeping a real executor does there: posting receives, sending). Each action's start is the longest path to it in the
graph of dependencies, so the result is exact, not sampled. A schedule whose ranks all wait for
each other is a **deadlock**: reported with what each rank waits for. From the timeline: each rank's
**idle fraction** 1 - busy / step; from the order alone: each stage's **peak** number of
micro-batches whose forward has run and whose backward (B, or W) has not.

``idle_fractions``, ``message_latency`` and ``action_overhead`` read the same figures off a timeline
measured on ranks: given the last two, the simulator predicts what the ranks measured, where the
formulas (latency and overhead zero) predict what ideal devices would.
"""

from __future__ import annotations

from dataclasses import dataclass

from d2lpar.infra.timing import Timeline
from d2lpar.strategies.pipeline.schedules import Action, Schedule, _needs, play_order, validate

__all__ = ["Simulation", "simulate", "peak_held", "idle_fractions", "message_latency",
           "action_overhead", "waits", "median"]


@dataclass
class Simulation:
    schedule: Schedule
    timeline: Timeline          # lanes 'rank r', labels '1F0'
    makespan: float
    idle: list[float]           # per rank: 1 - busy / makespan
    peak: list[int]             # per stage: most micro-batches whose activations it held at once

    @property
    def bubble(self) -> float:
        """Mean idle fraction over ranks."""
        return sum(self.idle) / len(self.idle)


def simulate(s: Schedule, durations: dict[str, float] | None = None,
             stage_scale: list[float] | None = None,
             latency: float = 0.0, overhead: float = 0.0) -> Simulation:
    """Play the schedule: each rank runs its actions in order, each as soon as its inputs arrived.

    durations: time per action kind, default F=1, B=2, I=1, W=1 (a backward costs two forwards);
    stage_scale: a factor per stage (a slower stage); latency: added to every message between ranks;
    overhead: the least gap between two actions of one rank.
    """
    validate(s)   # the rules first: a broken schedule is named, not played
    d = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, **(durations or {})}
    scale = stage_scale or [1.0] * s.stages
    end: dict[Action, float] = {}
    free = [0.0] * s.ranks
    tl = Timeline()
    started = [False] * s.ranks
    for r, a, deps in play_order(s):
        ready = max([free[r] + (overhead if started[r] else 0.0)]   # the rank is free, and
                    + [end[n] + (latency if s.rank_of(n.stage) != r else 0.0)   # every input
                       for n in deps])                                         # has arrived
        end[a] = ready + d[a.kind] * scale[a.stage]
        tl.add(f"rank {r}", str(a), ready, end[a])
        free[r], started[r] = end[a], True
    makespan = max(free)
    idle = [1.0 - tl.busy(f"rank {r}") / makespan for r in range(s.ranks)]
    return Simulation(s, tl, makespan, idle, peak_held(s))


def peak_held(s: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose forward has run and whose backward (B, or W) has not."""
    peak = [0] * s.stages
    held = [0] * s.stages
    for acts in s.order:
        for a in acts:
            if a.kind == "F":
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind in "BW":
                held[a.stage] -= 1
    return peak


def idle_fractions(timeline: Timeline, ranks: int) -> list[float]:
    """Per rank, 1 - (time in actions) / (first start to last end of the whole step)."""
    span = timeline.makespan()
    return [1.0 - timeline.busy(f"rank {r}") / span for r in range(ranks)]


def waits(timeline: Timeline, schedule: Schedule) -> tuple[list[float], list[float]]:
    """(latencies, gaps) of a measured timeline: for each action whose input came from another rank
    after its rank was free, the wait from that input's end to its start; for each action whose
    inputs were all there when its rank finished the previous one, the gap between the two."""
    spans = {sp.label: sp for sp in timeline.spans}
    backward = {(a.stage, a.mb): a for acts in schedule.order for a in acts if a.kind in "BI"}
    latencies, gaps = [], []
    for r, acts in enumerate(schedule.order):
        for prev, a in zip([None] + acts[:-1], acts):
            deps = _needs(schedule, a, backward)
            ready = max((spans[str(d)].end for d in deps), default=float("-inf"))
            free = spans[str(prev)].end if prev is not None else float("-inf")
            if ready > free:   # the rank had nothing to do: it waited for this input
                if any(schedule.rank_of(d.stage) != r for d in deps):
                    latencies.append(spans[str(a)].start - ready)
            elif prev is not None:
                gaps.append(spans[str(a)].start - free)
    return latencies, gaps


def median(samples: list[float]) -> float:
    samples = sorted(samples)
    return samples[len(samples) // 2] if samples else 0.0


def message_latency(timeline: Timeline, schedule: Schedule) -> float:
    """Median wait between an action's input being ready on another rank and the action starting,
    over the actions whose rank was idle waiting for that input (send, transfer, wake-up)."""
    return median(waits(timeline, schedule)[0])


def action_overhead(timeline: Timeline, schedule: Schedule) -> float:
    """Median gap between two actions of a rank when the second one's inputs were already there
    (the executor's own work between actions: posting receives, sending the last result)."""
    return median(waits(timeline, schedule)[1])
