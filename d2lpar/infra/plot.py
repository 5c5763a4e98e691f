"""Pictures the course draws: timelines (Gantt charts) of spans per device or rank.

``plot_timeline`` takes a ``d2lpar.infra.timing.Timeline`` (or its spans) and draws one row per lane with a
bar per span, coloured by label; times are shown from the earliest start, in milliseconds.
"""

from __future__ import annotations

from typing import Iterable

import matplotlib.pyplot as plt

from d2lpar.infra.timing import Span, Timeline

__all__ = ["plot_timeline", "label_colors"]

_PALETTE = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3",
            "#8C8C8C", "#CCB974", "#64B5CD"]


def label_colors(labels: Iterable[str]) -> dict[str, str]:
    """A stable colour per label, in order of first appearance."""
    return {lab: _PALETTE[i % len(_PALETTE)] for i, lab in enumerate(dict.fromkeys(labels))}


def plot_timeline(timeline: Timeline | Iterable[Span], ax=None, title: str | None = None,
                  lanes: list[str] | None = None, unit: str = "ms", figsize=(7, 2.5)):
    """Draw a Gantt chart of the spans; return the matplotlib Axes."""
    tl = timeline if isinstance(timeline, Timeline) else Timeline(timeline)
    if not tl.spans:
        raise ValueError("the timeline has no spans to draw")
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    t0 = min(s.start for s in tl.spans)
    lanes = lanes or tl.lanes
    colors = label_colors(s.label for s in tl.spans)
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    for row, lane in enumerate(lanes):
        for s in (s for s in tl.spans if s.lane == lane):
            ax.barh(row, (s.end - s.start) * scale, left=(s.start - t0) * scale, height=0.6,
                    color=colors[s.label], edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False,
              fontsize="small")
    if title:
        ax.set_title(title)
    ax.figure.tight_layout()
    return ax
