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

torch's default (``bucket_cap_mb`` not given) caps the *first* bucket, the last layers' gradients,
at ``dist._DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB and the others at 25 MiB, so that the first
all-reduce starts early; ``first_cap`` models it. Given ``bucket_cap_mb=25`` explicitly, torch uses
25 MiB for the first bucket too. That order is the one of torch's *rebuilt* buckets (from iteration
2, with ``find_unused_parameters=False``). With ``find_unused_parameters=True`` torch never rebuilds:
its 1 MiB bucket holds the first-registered parameters and is all-reduced *last*
(``torch/nn/parallel/distributed.py``, ``compute_bucket_size_limits`` and the reversed
``bucket_indices`` handed to the ``Reducer``).

``against_measured`` puts the model beside measured steps: the prediction is only as good as a, b
and the backward time, so measure them in the same run as the steps (on a shared CPU the latency
per message moves with the load), with T(K) timed the way DDP spends it (copies included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from d2lpar.cost.costmodel import Machine, allreduce_time

__all__ = ["BucketRun", "bucket_schedule", "best_cap", "uniform_step", "uniform_best_cap",
           "ring_terms", "fit_terms", "against_measured", "TORCH_FIRST_BUCKET"]

TORCH_FIRST_BUCKET = 2 ** 20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES (checked by a test)


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
                    allreduce_s: Callable[[float], float],
                    first_cap: int | None = None) -> BucketRun:
    """``layers``: (backward seconds, gradient bytes) in the order backward reaches them;
    ``first_cap``: the first bucket's cap (torch's default: ``TORCH_FIRST_BUCKET``)."""
    from d2lpar.strategies.data.ddp import assign_buckets   # torch: imported only when needed

    ready_at, t = [], 0.0
    for seconds, _ in layers:
        t += seconds
        ready_at.append(t)
    out, end = [], 0.0
    for bucket in assign_buckets([b for _, b in layers], cap, first_cap):
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
    """(a, b) fitted to measured all-reduce times, each size's *relative* error weighted alike
    (least squares on (a + K b - t) / t), so that the small sizes, which fix the latency a, count
    as much as the large ones, which fix b; a >= 0."""
    n = len(sizes)
    if n < 2 or len(seconds) != n:
        raise ValueError("fit_terms needs at least two measured sizes, one time for each")
    if any(t <= 0 for t in seconds):
        raise ValueError("fit_terms needs positive times: time each size first")
    # minimize sum w (a + K b - t)^2 with w = 1 / t^2: the 2x2 normal equations
    w = [1.0 / t ** 2 for t in seconds]
    s0, s1 = sum(w), sum(wi * k for wi, k in zip(w, sizes))
    s2 = sum(wi * k * k for wi, k in zip(w, sizes))
    t0 = sum(wi * t for wi, t in zip(w, seconds))
    t1 = sum(wi * k * t for wi, k, t in zip(w, sizes, seconds))
    det = s0 * s2 - s1 * s1
    b = (s0 * t1 - s1 * t0) / det
    if b <= 0:
        raise ValueError("all-reduce times do not grow with size: measure larger buckets")
    a = (t0 - b * s1) / s0
    if a < 0:  # no latency to speak of: a line through the origin
        a, b = 0.0, t1 / s2
    return a, b


def against_measured(rows, layers, a: float, b: float,
                     tolerance: float = 0.15) -> tuple[list[str], list[str]]:
    """The model's step for each measured cap, and what the comparison says.

    ``rows``: dicts with ``cap_mb``, ``buckets`` and the measured ``step`` (s); ``layers`` as for
    ``bucket_schedule``. The table's gap is measured / predicted - 1 (+31%: the step took 31%
    longer than the model says). Returns (table lines, verdict lines): whether every cap is within
    ``tolerance`` (relative) of its prediction, and whether the cap the model finds fastest
    measured within ``tolerance`` of the fastest measured one.
    """
    if not rows:
        raise ValueError("against_measured needs at least one measured cap")
    T = lambda k: a + k * b  # noqa: E731
    table = [f"{'cap MiB':>8} {'buckets':>8} {'measured ms':>12} {'predicted ms':>13} {'gap':>7}"
             f"   (gap = measured / predicted - 1)"]
    gaps, predicted = [], {}
    for row in rows:
        pred = bucket_schedule(layers, int(row["cap_mb"] * 2 ** 20), T).step
        predicted[row["cap_mb"]] = pred
        gaps.append(row["step"] / pred - 1)  # how far the measurement lies above the model
        table.append(f"{row['cap_mb']:8g} {row['buckets']:8} {row['step'] * 1e3:12.1f} "
                     f"{pred * 1e3:13.1f} {gaps[-1]:+7.0%}")
    worst = max(range(len(rows)), key=lambda i: abs(gaps[i]))
    where = f"worst gap {gaps[worst]:+.0%} at {rows[worst]['cap_mb']:g} MiB"
    if abs(gaps[worst]) <= tolerance:
        verdict = [f"the model predicts every cap within {tolerance:.0%} ({where})"]
    else:
        side = "above" if gaps[worst] > 0 else "below"
        verdict = [f"the model and the measurement disagree: {where} (measured {side}, "
                   f"over {tolerance:.0%})"]
    measured = {row["cap_mb"]: row["step"] for row in rows}
    fastest, model_pick = min(measured, key=measured.get), min(predicted, key=predicted.get)
    lost = measured[model_pick] / measured[fastest] - 1
    if model_pick == fastest:
        verdict.append(f"the model's best cap, {model_pick:g} MiB, is also the fastest measured")
    elif lost <= tolerance:
        verdict.append(f"the model's best cap, {model_pick:g} MiB, measured within {lost:.0%} of "
                       f"the fastest ({fastest:g} MiB)")
    else:
        verdict.append(f"the model's best cap, {model_pick:g} MiB, measured {lost:.0%} slower than "
                       f"the fastest ({fastest:g} MiB):\nthe model picks the wrong cap here")
    return table, verdict
