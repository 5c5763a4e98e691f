"""Sentences about timings, written by the code from the numbers it just measured.

A notebook that says "the copy hid behind the compute" in markdown is right on a quiet machine and
wrong on a busy one. The course prints such conclusions instead, from the figures of the same run,
so that what the reader sees always agrees with the numbers above it. Each function returns one
line.

* ``overlap_verdict(overlapped, a, b)``: two jobs of times a and b run together in ``overlapped``;
  the limit is max(a, b) (perfect overlap), one after the other is their sum a + b. The verdict
  reads the share of the shorter job that hid, hidden = (a + b - overlapped) / min(a, b): at least
  85 % is "overlapped", at most 15 % "no overlap", in between "partly"; it prints the ratio
  r = overlapped / max(a, b) and the sum's ratio beside it. Below the limit (r < 0.95, beyond
  timer noise) no overlap explains it: the cases were timed under different load, and the verdict
  says so instead of calling it overlap. Where less than the whole of
  the shorter job hid and the machine is busy (a one-minute load average above 1 per core), the
  verdict adds that the machine was too busy to show the mechanism: a rank that waits for a core
  cannot overlap anything.
* ``compare_verdict(name_a, a, name_b, b)``: which of two times is shorter, and whether the
  difference is larger than the run-to-run spread given (default 5 %). Within a wide spread (over
  10 %) it does not call the two equal: it says no difference was shown beyond the spread.
* ``agreement_verdict(measured, predicted, tolerance)``: whether a measurement is within a stated
  tolerance of a formula or a model, with the gap printed.
"""

from __future__ import annotations

__all__ = [
    "overlap_verdict", "hidden_fraction", "compare_verdict", "agreement_verdict", "busy_clause",
]


def hidden_fraction(overlapped: float, a: float, b: float) -> float:
    """Share of the shorter job that disappeared behind the longer one: 1 perfect, 0 none."""
    _positive(a=a, b=b, overlapped=overlapped)
    return (a + b - overlapped) / min(a, b)


BELOW = 0.95  # an overlapped run this far under the longer job alone is the load's, not overlap's


def overlap_verdict(overlapped: float, a: float, b: float, what: str = "transfer",
                    behind: str = "compute", close: float = 0.15) -> str:
    """One line on how much of the shorter of ``what`` (time b) and ``behind`` (time a) hid behind
    the longer one in this run, read from the share of the shorter job that hid.

    ``close``: a share this close to all (or to none) counts as all (or none): timer noise.
    """
    limit, serial = max(a, b), a + b
    ratio, hidden = overlapped / limit, hidden_fraction(overlapped, a, b)
    figures = f"({ratio:.2f}x the limit; their sum {serial / limit:.2f}x)"
    if ratio < BELOW:   # less than the longer part alone: the runs did not see the same machine
        return f"below the limit {figures}: the cases ran under different load; time them again"
    if hidden >= 1 - close:
        short, long = (what, behind) if b <= a else (behind, what)
        return f"overlapped {figures}: the {short} hid behind the {long}"
    if hidden < -close:  # longer than the two one after the other: they got in each other's way
        return (f"no overlap in this run {figures}: longer than one after the other, the two "
                f"slowed each other" + busy_clause())
    if hidden <= close:
        return f"no overlap in this run {figures}: as long as one after the other" + busy_clause()
    return f"partly overlapped {figures}: {hidden:.0%} of the shorter one hid" + busy_clause()


# One-minute load average per core above which a timing shows the other programs: a demonstration's
# own ranks already load a 2-core machine to about 1.5-1.9, so "busy" starts at one per core.
BUSY_PER_CORE = 1.0


def busy_clause() -> str:
    """'' on a quiet machine; on a busy one, a clause saying the machine was too busy to show it."""
    import os
    if not hasattr(os, "getloadavg"):
        return ""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= BUSY_PER_CORE * cores:
        return ""
    return (f"\n  (a busy machine, load {load:.1f} on {cores} CPU(s): work waited for cores;"
            f" run again when quiet)")


def compare_verdict(name_a: str, a: float, name_b: str, b: float, spread: float = 0.05) -> str:
    """``"<a> took 0.52x the time of <b>"``, or that they are equal within ``spread``."""
    _positive(**{name_a: a, name_b: b})
    ratio = a / b
    if abs(ratio - 1) <= spread:
        if spread <= 0.10:  # a tight spread: the two really are equal, as far as timing can say
            return f"{name_a} and {name_b} took the same time within {spread:.0%} ({ratio:.2f}x)"
        return (f"{name_a} took {ratio:.2f}x the time of {name_b}: no difference shown beyond "
                f"the run-to-run spread of {spread:.0%}")
    word = "less" if ratio < 1 else "more"
    return (f"{name_a} took {ratio:.2f}x the time of {name_b} "
            f"({word} time, beyond the {spread:.0%} spread)")


def agreement_verdict(what: str, measured: float, predicted: float, tolerance: float,
                      unit: str = "") -> str:
    """Whether ``measured`` is within ``tolerance`` (absolute, in ``unit``) of ``predicted``."""
    gap = measured - predicted
    figures = (f"measured {measured:.3f}{unit}, predicted {predicted:.3f}{unit}, "
               f"gap {gap:+.3f}{unit}")
    if abs(gap) <= tolerance:
        return f"{what} agrees with the prediction: {figures} (within {tolerance:g}{unit})"
    side = "above" if gap > 0 else "below"
    return f"{what} is {side} the prediction: {figures} (more than {tolerance:g}{unit})"


def _positive(**times: float) -> None:
    bad = [f"{k}={v!r}" for k, v in times.items() if not v > 0]
    if bad:
        raise ValueError(f"a verdict needs positive times; got {', '.join(bad)}: "
                         f"time the runs first")
