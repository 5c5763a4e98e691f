"""Gantt charts of pipeline schedules: one row per rank, one bar per action, from the schedule's data.

A bar is coloured by its kind (F forward, B backward, I input gradient, W weight gradient) and
labelled with its micro-batch; with several stages per rank (interleaving) a rank's later stage is
drawn in a lighter shade of the same colour, and the legend says so. The same function draws a
simulated timeline and one measured on real ranks: both are ``d2lpar.infra.timing.Timeline``
objects whose labels are actions such as ``"1F0"``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from d2lpar.infra.timing import Timeline
from d2lpar.strategies.pipeline.schedules import parse_action

__all__ = ["draw_pipeline"]

COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}


def lighter(color: str, amount: float = 0.5) -> tuple:
    """The colour mixed with white: a rank's later stage."""
    rgb = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * amount for c in rgb)


def draw_pipeline(timeline: Timeline, ax=None, title: str | None = None, unit: str | None = None,
                  ranks: int | None = None, figsize=(7.5, 1.9)):
    """Draw the actions of a pipeline timeline; return the Axes. ``unit='ms'`` for measured seconds."""
    if not timeline.spans:
        raise ValueError("the timeline has no actions to draw")
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    scale = {None: 1.0, "s": 1.0, "ms": 1e3}[unit]
    t0 = min(s.start for s in timeline.spans)
    ranks = ranks or 1 + max(int(s.lane.split()[-1]) for s in timeline.spans)
    total = max(s.end for s in timeline.spans) - t0
    width_in = ax.get_position().width * ax.figure.get_figwidth()   # inches for the whole step
    later_seen = False
    for s in timeline.spans:
        a = parse_action(s.label)
        r = int(s.lane.split()[-1])
        later = a.stage >= ranks   # a rank's second (third ...) stage under interleaving
        later_seen |= later
        ax.barh(r, (s.end - s.start) * scale, left=(s.start - t0) * scale, height=0.7,
                color=lighter(COLORS[a.kind]) if later else COLORS[a.kind], edgecolor="white",
                linewidth=0.5)
        bar_in = (s.end - s.start) / total * width_in if total > 0 else 0.0
        if bar_in >= 0.07 * len(str(a.mb)) + 0.06:   # room for the number at 8, and a margin
            ax.text((s.start - t0 + (s.end - s.start) / 2) * scale, r, str(a.mb), ha="center",
                    va="center", fontsize=8, fontweight="bold", color="black" if later else "white")
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlabel("time (ms)" if unit == "ms" else "time (units of one forward)" if unit is None else f"time ({unit})")
    kinds = sorted({parse_action(s.label).kind for s in timeline.spans}, key="FBIW".index)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds]
    labels = list(kinds)
    if later_seen:   # one lighter swatch per kind: the rank's later stage
        handles += [plt.Rectangle((0, 0), 1, 1, color=lighter(COLORS[k])) for k in kinds]
        labels += [f"{k}, later stage" for k in kinds]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False,
              fontsize="small")
    if title:
        ax.set_title(title, fontsize="medium")
    ax.figure.tight_layout()
    return ax
