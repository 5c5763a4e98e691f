"""Pipeline schedules as data: which stage does what to which micro-batch, in what order, on each rank.

A model cut into S stages runs on p ranks; the batch is cut into m micro-batches. An **action** is
``(stage, kind, micro-batch)``, written ``"1F0"``: stage 1 runs the forward of micro-batch 0. Kinds:
F (forward), B (backward), and for zero-bubble schedules B split in two, I (gradient of the stage's
input, which the previous stage is waiting for) and W (gradient of the weights, which nobody waits
for). A **schedule** is, per rank, an ordered list of actions. Stage s lives on rank ``s % p`` (with
v stages per rank, rank r holds stages r, r+p, r+2p, ...: the *looped* placement of interleaving).

The same lists drive the executor (``executor``), the Gantt charts and the bubble and memory
figures. With equal times per stage (tF forward, tB backward) a rank of GPipe or 1F1B is busy
m (tF + tB) out of a step of (m + p - 1)(tF + tB), so its **idle fraction** is

    GPipe, 1F1B:          (p - 1) / (m + p - 1)       (Megatron's ratio bubble/ideal: (p - 1) / m)
    interleaved, v/rank:  (p - 1) / (v m + p - 1)     (each stage does 1/v of a rank's layers)
    ZB-H1, tF = tI = tW:  (p - 1) / (3 m + p - 1)     (m >= p; bubble (p-1)(tF + tI - tW), not (p-1)(tF + tB))

GPipe keeps all m micro-batches' activations until its backwards start; 1F1B starts backwards early
and stage s never holds more than min(p - s, m). ``validate`` names the first rule a schedule breaks,
a deadlock included (found by ``play_order``: every rank's list played in order, each action once
its inputs are done); ``simulator.simulate`` plays the same order with durations and returns its
timeline, each rank's idle fraction and each stage's peak number of micro-batches held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Action", "Schedule", "ScheduleError", "naive", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "zb_h1", "SCHEDULES", "make_schedule", "validate", "play_order", "format_order",
           "split_layers", "parse_action"]

KINDS = "FBIW"


class Action(NamedTuple):
    stage: int
    kind: str      # 'F', 'B', 'I' or 'W'
    mb: int        # micro-batch

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def parse_action(text: str) -> Action:
    """``"1F0"`` -> ``Action(1, 'F', 0)``."""
    for i, ch in enumerate(text):
        if ch in KINDS:
            return Action(int(text[:i]), ch, int(text[i + 1:]))
    raise ValueError(f"{text!r} is not an action: write stage, kind (one of {KINDS}), micro-batch, as '1F0'")


class ScheduleError(ValueError):
    """A schedule breaks a rule (the message names the rule and the first action that breaks it)."""


@dataclass
class Schedule:
    name: str
    ranks: int                  # p
    microbatches: int           # m
    order: list[list[Action]]   # order[rank] = that rank's actions, in order
    stages_per_rank: int = 1    # v

    @property
    def stages(self) -> int:
        return self.ranks * self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.stages, self.ranks))

    @property
    def split(self) -> bool:
        """True when backwards are split into I and W (zero-bubble)."""
        return any(a.kind == "I" for acts in self.order for a in acts)

    def __str__(self) -> str:
        return format_order(self)


def format_order(schedule: Schedule, mark: Action | None = None, columns: int = 96) -> str:
    """The rank x step grid, one row per rank; ``mark`` is shown as ``>1F0<``. A grid wider than
    ``columns`` characters is cut into blocks of steps, one under the other, blank-line apart."""
    width = max((len(str(a)) for acts in schedule.order for a in acts), default=3) + 2
    lines = [f"{schedule.name}: p={schedule.ranks}, m={schedule.microbatches}"
             + (f", v={schedule.stages_per_rank}" if schedule.stages_per_rank > 1 else "")]
    label = len(f"rank {schedule.ranks - 1}:")
    per_block = max(1, (columns - label) // width)
    steps = max((len(acts) for acts in schedule.order), default=0)
    for first in range(0, max(steps, 1), per_block):
        if first:
            lines.append("")
        for r, acts in enumerate(schedule.order):
            cells = [(f">{a}<" if a == mark else f" {a} ").rjust(width)
                     for a in acts[first:first + per_block]]
            lines.append(f"rank {r}:".ljust(label) + "".join(cells))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ generators

def _check(p: int, m: int) -> None:
    if not (isinstance(p, int) and isinstance(m, int)) or p < 1 or m < 1:
        raise ScheduleError(f"need p >= 1 ranks and m >= 1 micro-batches, got p={p!r}, m={m!r}")


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (Huang et al. 2019). Without the paper's re-materialization
    (its section 2.3: keep each micro-batch's stage input, recompute the rest in the backward),
    every stage holds m micro-batches."""
    _check(p, m)
    order = [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
             for r in range(p)]
    return Schedule("GPipe", p, m, order)


def naive(p: int) -> Schedule:
    """Model parallelism as usually written: the whole batch is one micro-batch (GPipe with m = 1)."""
    s = gpipe(p, 1)
    s.name = "naive"
    return s


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): p-1-r warm-up forwards, then one forward one backward, then the
    rest.

    With m < p it still runs correctly: warm-up is cut to m and the schedule is GPipe's on the
    first stages (there are not enough micro-batches to alternate), with GPipe's bubble.
    """
    _check(p, m)
    order = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action(r, "F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action(r, "F", warm + i), Action(r, "B", i)]
        acts += [Action(r, "B", i) for i in range(m - warm, m)]
        order.append(acts)
    return Schedule("1F1B", p, m, order)


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: v stages per rank (looped), micro-batches in groups of p.

    Rank r's k-th forward is micro-batch (k // pv) p + k % p on its chunk (k // p) % v; backwards
    go through the chunks in reverse. Warm-up: 2(p - 1 - r) + (v - 1) p forwards (all when m = p).
    """
    _check(p, m)
    if not isinstance(v, int) or v < 1:
        raise ScheduleError(f"v (stages per rank) must be a whole number >= 1, got {v!r}")
    if v == 1:
        s = one_f_one_b(p, m)
        s.name = "interleaved 1F1B"
        return s
    if m % p:
        raise ScheduleError(f"interleaved 1F1B sends micro-batches round the ranks in groups of "
                            f"p={p}, so m must be a multiple of p: m={m} is not. Use "
                            f"m={m + (-m) % p} (or m={m - m % p}), or plain 1F1B")
    total = m * v

    def action(r: int, k: int, kind: str) -> Action:
        chunk = (k // p) % v
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(chunk * p + r, kind, (k // (p * v)) * p + k % p)

    order = []
    for r in range(p):
        warm = total if m == p else min(2 * (p - 1 - r) + (v - 1) * p, total)
        acts = [action(r, k, "F") for k in range(warm)]
        for k in range(total - warm):
            acts += [action(r, warm + k, "F"), action(r, k, "B")]
        acts += [action(r, k, "B") for k in range(total - warm, total)]
        order.append(acts)
    return Schedule("interleaved 1F1B", p, m, order, stages_per_rank=v)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): backward split into I and W, and the Ws moved into the bubble.

    Rank r: p - r warm-up forwards; then for each micro-batch k its I, the W of micro-batch k - r
    (rank r's Ws lag r micro-batches behind its Is), and the next forward; then the remaining Ws.
    Only F and I are on the critical path (the next stage waits for them, nobody waits for a W),
    so the bubble shrinks from (p - 1)(tF + tB) to (p - 1)(tF + tI - tW) when m >= p and
    tW <= tF, tI (a W then fits in the wait it fills; a longer W makes the step longer than that).
    Every stage holds at most min(p, m) micro-batches until their W: 1F1B's largest (its first
    stage's)."""
    _check(p, m)
    order = []
    for r in range(p):
        warm = min(p - r, m)
        acts, w = [Action(r, "F", k) for k in range(warm)], 0
        for k in range(m):
            acts.append(Action(r, "I", k))
            if k >= r:
                acts.append(Action(r, "W", w))
                w += 1
            if warm + k < m:
                acts.append(Action(r, "F", warm + k))
        acts += [Action(r, "W", k) for k in range(w, m)]
        order.append(acts)
    return Schedule("ZB-H1", p, m, order)


SCHEDULES = {"naive": lambda p, m, v=1: naive(p), "GPipe": lambda p, m, v=1: gpipe(p, m),
             "1F1B": lambda p, m, v=1: one_f_one_b(p, m),
             "interleaved 1F1B": lambda p, m, v=2: interleaved_1f1b(p, m, v),
             "ZB-H1": lambda p, m, v=1: zb_h1(p, m)}


def make_schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """One of ``SCHEDULES`` by name (v only for interleaved)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {list(SCHEDULES)}")
    return SCHEDULES[name](p, m) if v is None else SCHEDULES[name](p, m, v)


def split_layers(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of each stage's layers: near-equal parts, the first ones larger."""
    if stages < 1 or n_layers < stages:
        raise ScheduleError(f"cannot split {n_layers} layers into {stages} stages: each stage needs at "
                            f"least one layer. Use at most {n_layers} stages (ranks x stages per rank), "
                            "or a deeper model")
    base, extra = divmod(n_layers, stages)
    bounds, start = [], 0
    for s in range(stages):
        stop = start + base + (s < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


# ------------------------------------------------------------------------ dependencies, validation

def _needs(s: Schedule, a: Action, backward: dict) -> list[Action]:
    """The actions that must finish before ``a`` can start (their outputs are its inputs)."""
    if a.kind == "F":
        return [Action(a.stage - 1, "F", a.mb)] if a.stage > 0 else []
    if a.kind == "W":
        return [Action(a.stage, "I", a.mb)]
    deps = [Action(a.stage, "F", a.mb)]
    if a.stage < s.stages - 1:
        deps.append(backward.get((a.stage + 1, a.mb), Action(a.stage + 1, "B", a.mb)))
    return deps


def validate(s: Schedule) -> Schedule:
    """Return the schedule if it can run; raise ScheduleError naming the first broken rule."""
    def fail(msg: str, a: Action | None = None):
        raise ScheduleError(msg + "\n" + format_order(s, a))

    if len(s.order) != s.ranks:
        fail(f"the schedule has {len(s.order)} rows but p={s.ranks} ranks: give one list per rank")
    where: dict[Action, tuple[int, int]] = {}
    for r, acts in enumerate(s.order):
        for i, a in enumerate(acts):
            if a.kind not in KINDS or not 0 <= a.stage < s.stages or not 0 <= a.mb < s.microbatches:
                fail(f"{a} on rank {r} is not an action of this schedule (stages 0..{s.stages - 1}, "
                     f"kinds {KINDS}, micro-batches 0..{s.microbatches - 1})", a)
            if s.rank_of(a.stage) != r:
                fail(f"{a} is on rank {r}, but stage {a.stage} lives on rank {s.rank_of(a.stage)}", a)
            if a in where:
                fail(f"every action exactly once: {a} appears twice on rank {r} (steps {where[a][1]} and {i})", a)
            where[a] = (r, i)
    backward = {}
    for stage in range(s.stages):
        for mb in range(s.microbatches):
            f, b, i, w = (Action(stage, k, mb) for k in "FBIW")
            for need in ([f] + ([i, w] if i in where or w in where else [b])):
                if need not in where:
                    fail(f"every action exactly once: {need} is missing")
            if b in where and i in where:
                fail(f"{b} and {i} both appear: a backward is either B, or I then W, not both", b)
            backward[(stage, mb)] = i if i in where else b
            if where[f][1] > where[backward[(stage, mb)]][1]:
                fail(f"B after F: {backward[(stage, mb)]} comes before {f} on rank {where[f][0]}",
                     backward[(stage, mb)])
            if i in where and where[i][1] > where[w][1]:
                fail(f"I before W: {w} comes before {i} on rank {where[w][0]}", w)
            nf, nb = Action(stage + 1, "F", mb), backward.get((stage + 1, mb))
            if nf in where and where[nf][0] == where[f][0] and where[nf][1] < where[f][1]:
                fail(f"F of micro-batch {mb} on stage {stage} before stage {stage + 1}: {nf} comes "
                     f"before {f} on rank {where[f][0]}", nf)
    for stage in range(s.stages - 1, 0, -1):   # backwards in reverse stage order, same rank
        for mb in range(s.microbatches):
            a, prev = backward[(stage - 1, mb)], backward[(stage, mb)]
            if where[a][0] == where[prev][0] and where[a][1] < where[prev][1]:
                fail(f"B in the reverse order: {a} comes before {prev} on rank {where[a][0]}", a)
    for _ in play_order(s):   # raises on a deadlock
        pass
    return s


def play_order(s: Schedule):
    """Yield ``(rank, action, needs)`` in an order that keeps each rank's list and runs every action
    after the actions it needs; raise ScheduleError naming what each rank waits for on a deadlock."""
    backward = {(a.stage, a.mb): a for acts in s.order for a in acts if a.kind in "BI"}
    done: set[Action] = set()
    pos = [0] * s.ranks
    while not all(pos[r] == len(acts) for r, acts in enumerate(s.order)):
        progressed = False
        for r, acts in enumerate(s.order):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                deps = _needs(s, a, backward)
                if any(n not in done for n in deps):
                    break
                yield r, a, deps
                done.add(a)
                pos[r] += 1
                progressed = True
        if not progressed:
            waits = [f"rank {r} waits at {acts[pos[r]]} for "
                     + ", ".join(str(n) for n in _needs(s, acts[pos[r]], backward) if n not in done)
                     for r, acts in enumerate(s.order) if pos[r] < len(acts)]
            first = min(r for r in range(s.ranks) if pos[r] < len(s.order[r]))
            raise ScheduleError("deadlock: every rank waits for another: " + "; ".join(waits) + "\n"
                                + format_order(s, s.order[first][pos[first]]))
