"""How long a DDP step takes when bucket all-reduces overlap backward, and the best bucket size.

Backward produces the gradients layer by layer (last layer first). Layer i takes c_i seconds and
yields g_i bytes. Buckets are cut from that order by ``d2lpar.strategies.data.ddp.assign_buckets``;
bucket b is *ready* at r_b, the time its last layer is done. All-reduces run one at a time, in
bucket order, each taking ``T(K) = a + K b`` for K bytes (for a ring over W devices with latency
alpha and bandwidth beta, a = 2(W-1) alpha and b = 2(W-1) / (W beta), plus adding):

    start_b = max(r_b, end_{b-1}),   end_b = start_b + T(K_b),   step = max(sum c_i, end_last).

Small buckets start early but pay the latency a often; a large bucket pays it once but starts late,
and the last bucket's all-reduce cannot overlap anything. With backward time B spread evenly over G
bytes and buckets of C bytes (n = G / C of them), the step is

    t(C) = max( B + a + C b ,  C B / G + (G / C)(a + C b) )
           (comm keeps up: only      (comm is the bottleneck: wait for the first
            the last bucket shows)    bucket, then n all-reduces back to back)

The second term is smallest at C_2 = G sqrt(a / B). If the first term is the larger there, the best
C is smaller: where the two terms meet (a quadratic in C). ``uniform_best_cap`` computes this;
``best_cap`` searches the exact schedule of a given model. Both need only a, b and the backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from d2lpar.cost.costmodel import Machine, allreduce_time
from d2lpar.strategies.data.ddp import assign_buckets

__all__ = ["BucketRun", "bucket_schedule", "best_cap", "uniform_step", "uniform_best_cap",
           "ring_terms", "fit_terms"]


@dataclass
class BucketRun:
    """The predicted schedule: per bucket (bytes, ready, start, end) and the step time."""
    buckets: list[tuple[int, float, float, float]]
    compute: float

    @property
    def step(self) -> float:
        return max(self.compute, self.buckets[-1][3] if self.buckets else 0.0)

    @property
    def communication(self) -> float:
        return sum(e - s for _, _, s, e in self.buckets)

    @property
    def exposed(self) -> float:
        """Communication time not hidden behind backward."""
        return self.step - self.compute


def bucket_schedule(layers: Sequence[tuple[float, int]], cap: int,
                    allreduce_s: Callable[[float], float]) -> BucketRun:
    """``layers``: (backward seconds, gradient bytes) in the order backward reaches them."""
    ready_at, t = [], 0.0
    for seconds, _ in layers:
        t += seconds
        ready_at.append(t)
    out, end = [], 0.0
    for bucket in assign_buckets([b for _, b in layers], cap):
        nbytes = sum(layers[i][1] for i in bucket)
        ready = ready_at[bucket[-1]]
        start = max(ready, end)
        end = start + allreduce_s(nbytes)
        out.append((nbytes, ready, start, end))
    return BucketRun(out, t)


def best_cap(layers, allreduce_s, caps: Sequence[int] | None = None) -> tuple[int, BucketRun]:
    """The cap (bytes) among ``caps`` (default: powers of two from 1 KiB) with the shortest
    predicted step; among caps that tie, the largest."""
    total = sum(b for _, b in layers)
    caps = caps or [2 ** k for k in range(10, max(11, math.ceil(math.log2(total)) + 1))]
    steps = {c: bucket_schedule(layers, c, allreduce_s).step for c in caps}
    fastest = min(steps.values())
    # Caps that cut the same buckets tie: report the largest (the fewest buckets for that time).
    cap = max(c for c, t in steps.items() if t <= fastest * (1 + 1e-9))
    return cap, bucket_schedule(layers, cap, allreduce_s)


def uniform_step(cap: float, compute: float, total_bytes: float, a: float, b: float) -> float:
    """t(C) of the docstring: backward ``compute`` s spread evenly over ``total_bytes``."""
    n = max(1.0, total_bytes / cap)
    cap = total_bytes / n
    return max(compute + a + cap * b, compute / n + n * (a + cap * b))


def uniform_best_cap(compute: float, total_bytes: float, a: float, b: float) -> float:
    """The C that minimizes t(C): C_2 = G sqrt(a/B), or where the two terms meet if smaller."""
    if compute <= 0 or a <= 0:
        return float(total_bytes)  # nothing to hide behind, or no latency to save: one bucket
    G, B = float(total_bytes), compute
    c2 = min(G, G * math.sqrt(a / B))
    f1 = lambda c: B + a + c * b  # noqa: E731
    f2 = lambda c: c * B / G + (G / c) * (a + c * b)  # noqa: E731
    if f1(c2) <= f2(c2):
        return c2
    # (b - B/G) C^2 + (B + a - G b) C - G a = 0, the root between 0 and C_2
    qa, qb, qc = b - B / G, B + a - G * b, -G * a
    if abs(qa) < 1e-30:
        return -qc / qb
    disc = math.sqrt(max(0.0, qb * qb - 4 * qa * qc))
    roots = [r for r in ((-qb + disc) / (2 * qa), (-qb - disc) / (2 * qa)) if 0 < r <= c2 * (1 + 1e-9)]
    return min(roots) if roots else c2


def ring_terms(machine: Machine, world: int) -> tuple[float, float]:
    """(a, b) of ``T(K) = a + K b`` for a ring all-reduce on ``machine`` with ``world`` devices."""
    t0 = allreduce_time("ring", 0, world, machine)
    t1 = allreduce_time("ring", 2 ** 30, world, machine)
    return t0, (t1 - t0) / 2 ** 30


def fit_terms(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(a, b) fitted by least squares to measured all-reduce times (a >= 0)."""
    n = len(sizes)
    if n < 2:
        raise ValueError("fit_terms needs at least two measured sizes")
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    b = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sxx
    if b <= 0:
        raise ValueError("all-reduce times do not grow with size: measure larger buckets")
    return max(0.0, my - b * mx), b
