"""The pipeline bubble and activation memory, as formulas (the simulator and the executor check them).

Two definitions of "the bubble" are in use; this module gives both and the course says which it uses.

* **Idle fraction of the step** (what a timeline shows): a rank is busy m (tF + tB) in a step of
  (m + p - 1)(tF + tB) for GPipe and 1F1B with equal stage times, so it idles

      (p - 1) / (m + p - 1).

* **Megatron's bubble ratio** (Narayanan et al. 2021): bubble time over ideal time, (p - 1) / m.
  The two agree for m >> p and differ a lot for small m (m = 1: 1 - 1/p against p - 1).

Interleaving v stages per rank cuts each stage's time by v but not the number of stages to fill, so
the bubble is divided by v: (p - 1) / (v m + p - 1), ratio (p - 1) / (v m). ZB-H1 splits the backward
into I (input gradient, on the critical path) and W (weight gradient, off it): the bubble becomes
(p - 1)(tF + tI - tW) in a step of m (tF + tI + tW) plus the bubble (m >= p; tW <= tF and tW <= tI,
so that a W fits in the wait it fills); with tF = tI = tW,
(p - 1) / (3 m + p - 1), a third of 1F1B's bubble time (Qi et al. 2023, section 2.1, Figure 3). With
m < p the last Ws of ``d2lpar.strategies.pipeline.schedules.zb_h1`` cannot hide and the step is
longer by (p - m) units: the FORMULAS entry for m < p describes that generator's W placement, not a
figure of the paper.

Activation memory, in micro-batches held per stage s: GPipe m; 1F1B min(p - s, m); ZB-H1 min(p, m)
on every stage (until W); interleaved 1F1B, the chunks of its warm-up plus one, over v
(``stage_peak``). The planner's bubble is idle over busy time, i / (1 - i) (``bubble_ratio``).

Two checks a notebook can run and fail: ``ordering_claims`` (for m >= p and v = 2 the bubbles order
ZB-H1 < interleaved 1F1B < 1F1B == GPipe; measured figures are held only to the claims whose margin
survives a busy machine) and ``against_simulator`` (the simulator, playing each generator's lists,
meets the formula for every p and m asked).
"""

from __future__ import annotations

import functools

__all__ = ["idle_fraction", "megatron_ratio", "peak_microbatches", "FORMULAS", "ordering_claims",
           "against_simulator", "bubble_ratio", "stage_peak"]

FORMULAS = {
    "naive": "(p - 1) / p",
    "GPipe": "(p - 1) / (m + p - 1)",
    "1F1B": "(p - 1) / (m + p - 1)",
    "interleaved 1F1B": "(p - 1) / (v m + p - 1)",
    "ZB-H1": "(p - 1 + max(0, p - m)) / (3 m + p - 1 + max(0, p - m))",
}


def idle_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Each rank's idle fraction of a step, equal stage times (ZB-H1: tF = tI = tW; others: any
    tF, tB)."""
    if schedule == "naive":
        m = 1
    if schedule in ("naive", "GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved 1F1B":
        return (p - 1) / (v * m + p - 1)
    if schedule == "ZB-H1":
        extra = max(0, p - m)
        return (p - 1 + extra) / (3 * m + p - 1 + extra)
    raise ValueError(f"no formula for {schedule!r}: choose one of {list(FORMULAS)}")


def megatron_ratio(p: int, m: int, v: int = 1) -> float:
    """Bubble time over ideal compute time, (p - 1) / (v m)."""
    return (p - 1) / (v * m)


def bubble_ratio(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Bubble time over busy time, i / (1 - i) for the idle fraction i: (p - 1) / m for GPipe and
    1F1B (``megatron_ratio``), (p - 1) / (v m) interleaved, (p - 1 + max(0, p - m)) / (3 m) for
    ZB-H1 (in units of tF = tI = tW)."""
    i = idle_fraction(schedule, p, m, v)
    return i / (1 - i)


@functools.lru_cache(maxsize=4096)
def stage_peak(schedule: str, p: int, m: int, v: int = 1, stage: int = 0) -> float:
    """The most micro-batches' worth of its activations ``stage`` holds at once.

    GPipe, 1F1B and ZB-H1: ``peak_microbatches``. Interleaved 1F1B
    (``strategies.pipeline.schedules.interleaved_1f1b``): rank r runs 2(p - 1 - r) + (v - 1) p
    forward chunks before its first backward (all v m when m = p), one more in the steady state,
    each chunk 1/v of the stage: on the first rank p + (p - 1)/v micro-batches for m > p,
    Korthikanti et al. 2022's factor 1 + (p - 1)/(p v) over 1F1B's p (section 4.2.3)."""
    if schedule != "interleaved 1F1B" or v == 1:
        name = "1F1B" if schedule == "interleaved 1F1B" else schedule
        return float(peak_microbatches(name, p, m)[stage])
    total = v * m
    warm = total if m == p else min(2 * (p - 1 - stage) + (v - 1) * p, total)
    return min(warm + 1, total) / v


def peak_microbatches(schedule: str, p: int, m: int) -> list[int]:
    """Per stage, the most micro-batches whose activations it holds at once."""
    if schedule == "naive":
        return [1] * p
    if schedule == "GPipe":
        return [m] * p
    if schedule == "1F1B":
        return [min(p - s, m) for s in range(p)]
    if schedule == "ZB-H1":
        return [min(p, m)] * p
    raise ValueError(f"no activation formula for {schedule!r}: choose GPipe, 1F1B, ZB-H1 or naive")


def ordering_claims(bubbles: dict[str, float], measured: bool = False) -> list[tuple[str, bool]]:
    """[(claim, holds)] on idle fractions of GPipe, 1F1B, interleaved 1F1B (v = 2) and ZB-H1 at one
    p and m >= p. Exact figures (formula, simulator): ZB-H1 < interleaved < 1F1B == GPipe. Measured
    figures (message latency and late wake-ups add to each): only that interleaving and ZB-H1 idle
    less than both GPipe and 1F1B, the gaps that are large (p - 1)/(m + p - 1) - the smaller one."""
    b = bubbles
    plain = min(b["GPipe"], b["1F1B"])
    claims = [("interleaved 1F1B idles less than GPipe and 1F1B", b["interleaved 1F1B"] < plain),
              ("ZB-H1 idles less than GPipe and 1F1B", b["ZB-H1"] < plain)]
    if not measured:
        claims += [("ZB-H1 idles less than interleaved 1F1B", b["ZB-H1"] < b["interleaved 1F1B"]),
                   ("1F1B idles exactly as GPipe", abs(b["1F1B"] - b["GPipe"]) < 1e-12)]
    return claims


def against_simulator(ps=(2, 4, 8), ms=(1, 4, 8, 16, 32),
                      make=None) -> tuple[list[list], list[str]]:
    """(rows, mismatches): per (p, m) the simulated idle fraction of GPipe, 1F1B, interleaved
    (v = 2, None unless p divides m) and ZB-H1 with tF = tI = tW = tB / 2, and every entry that is
    not the formula. ``make(name, p, m, v)`` builds the schedule (default: d2lpar's generators)."""
    from d2lpar.strategies.pipeline.schedules import make_schedule
    from d2lpar.strategies.pipeline.simulator import simulate
    make = make or make_schedule
    rows, mismatches = [], []
    for p in ps:
        for m in ms:
            row = [p, m]
            for name in ("GPipe", "1F1B", "interleaved 1F1B", "ZB-H1"):
                v = 2 if name == "interleaved 1F1B" else 1
                if v > 1 and m % p:
                    row.append(None)
                    continue
                sim = simulate(make(name, p, m, v), {"F": 1 / v, "B": 2 / v, "I": 1, "W": 1}).bubble
                if abs(sim - idle_fraction(name, p, m, v)) > 1e-12:
                    mismatches.append(f"{name} p={p} m={m}: simulated {sim:.4f}, formula "
                                      f"{idle_fraction(name, p, m, v):.4f}")
                row.append(sim)
            rows.append(row)
    return rows, mismatches
