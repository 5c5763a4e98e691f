"""Gantt charts of pipeline schedules: one row per rank, one bar per action, from the schedule's data.

A bar is coloured by its kind (F forward, B backward, I input gradient, W weight gradient) and
labelled with its micro-batch; with several stages per rank the stage is shaded (a lighter bar for
the later stage). The same function draws a simulated timeline and one measured on real ranks: both
are ``d2lpar.infra.timing.Timeline`` objects whose labels are actions such as ``"1F0"``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from d2lpar.infra.timing import Timeline
from d2lpar.strategies.pipeline.schedules import parse_action

__all__ = ["draw_pipeline"]

COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}


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
    for s in timeline.spans:
        a = parse_action(s.label)
        r = int(s.lane.split()[-1])
        later = a.stage >= ranks   # a rank's second (third ...) stage under interleaving
        ax.barh(r, (s.end - s.start) * scale, left=(s.start - t0) * scale, height=0.7,
                color=COLORS[a.kind], alpha=0.55 if later else 1.0, edgecolor="white", linewidth=0.5)
        if (s.end - s.start) * scale > 0:
            ax.text((s.start - t0 + (s.end - s.start) / 2) * scale, r, str(a.mb), ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlabel("time (ms)" if unit == "ms" else "time (units of one forward)" if unit is None else f"time ({unit})")
    kinds = sorted({parse_action(s.label).kind for s in timeline.spans}, key="FBIW".index)
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds], kinds, loc="upper left",
              bbox_to_anchor=(1.01, 1), frameon=False, fontsize="small")
    if title:
        ax.set_title(title, fontsize="medium")
    ax.figure.tight_layout()
    return ax
