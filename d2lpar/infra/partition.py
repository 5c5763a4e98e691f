"""Cutting a sequence of weights into contiguous pieces whose largest is as small as possible.

Model parallelism puts consecutive layers on consecutive devices, and the slowest (or fullest)
device sets the pace, so the cut to pick minimises the largest piece. With prefix sums
P[j] = w_0 + ... + w_{j-1}, the best largest piece for the first j weights in g pieces is

    best[g][j] = min over i < j of max(best[g-1][i], P[j] - P[i]),

an O(parts * n^2) dynamic programme; remembering the i that won gives the cuts back.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["balanced_bounds"]


def balanced_bounds(weights: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: ``parts`` contiguous pieces of ``weights`` (none empty) whose
    largest sum is the smallest possible. The caller checks ``1 <= parts <= len(weights)``."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]   # best[g][j]: g pieces, j weights
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for g in range(1, parts + 1):
        for j in range(g, n + 1):
            for i in range(g - 1, j):
                cost = max(best[g - 1][i], prefix[j] - prefix[i])
                if cost < best[g][j]:
                    best[g][j], cut[g][j] = cost, i
    bounds, j = [], n
    for g in range(parts, 0, -1):
        bounds.append((cut[g][j], j))
        j = cut[g][j]
    return bounds[::-1]
