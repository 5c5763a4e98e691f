"""Is this loss curve numerics or a bug? Train every layout, compare each step with one device,
against a noise band measured first.

**The band.** Two correct runs of the same training differ by rounding only: a sum in another order
rounds differently, and training magnifies the difference step after step. The checker measures how
far that goes for *this* model, data, dtype, learning rate, optimizer and number of steps, on one
device, before any layout runs: the reference run, then the same run with its reductions in other
orders ("reversed": each matmul summed as two halves of its inputs, second half first, as a
row-parallel layer's ranks sum them, and the batch as two micro-batches, the second first; "rows":
every row its own micro-batch, the last first, and each matmul as four quarters of its inputs,
the last first) and, for bf16, "fp32": the bf16-rounded inputs and weights summed in fp32 with the
output kept in fp32 instead of rounded to bf16. At step k the measured spread is the largest
difference so far between the reference and any of these runs; the floor is one fp32 rounding unit
of the value (the largest so far: the loss and the norms are fp32 sums, so two correct orders
differ by about one unit, and before the first update they may agree exactly); the band is
``factor`` times the larger of the two. Both are kept (``Band.measured``, ``Band.floor``): in fp32,
over tens of steps, the reorderings move the loss and the gradient norm by about one rounding
unit, so their bands are about the floor, while the weights' band is measured far above it.

**The comparison**, per layout and step: the loss (the mean cross-entropy of the real tokens the
layout read), and at the checked steps the gradient norm (of the reduced gradients, before the
optimizer) and the weights (every rank's copy of every part, before the optimizer): the largest
difference from one device. The verdict is one line: "within the band", or "outside the band from
step k" with what left it first. A layout whose rounding differs from one device only by order
stays inside; a bug that changes what is computed leaves it, at the first step where it acts.

``check_layouts`` checks every input before any rank starts, runs the layouts of each world size in
one launch, and returns a ``Report``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from d2lpar.processes.launch import launch
from d2lpar.strategies.agreement import rules
from d2lpar.strategies.agreement.layouts import Layout, check_layout
from d2lpar.strategies.agreement.model import Config, at, build, token_loss
from d2lpar.strategies.agreement.runners import LR, train_course
from d2lpar.strategies.agreement.torch_layouts import train_torch

__all__ = ["Run", "Band", "Verdict", "Report", "one_device", "measure_band", "check_layouts",
           "FACTOR", "EPS32"]

FACTOR = 4.0                        # how many measured spreads a layout may differ by
EPS32 = torch.finfo(torch.float32).eps


@dataclass
class Run:
    """One training: per step the loss; at the checked steps, the gradient norm and the weights."""
    losses: list[float]
    grad_norms: dict[int, float] = field(default_factory=dict)
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    copies: dict[int, list[dict]] = field(default_factory=dict)   # every rank's parts (layouts)


def one_device(cfg: Config, batches, steps: int, checks=(), dtype: str = "fp32",
               order: str = "reference", lr: float = LR, loss=rules.global_tokens) -> Run:
    """The one-device training every layout is compared with. ``order``: "reference"; "reversed"
    (each matmul as two halves of its inputs, the second first, and the batch as two micro-batches,
    the second first); "rows" (each row its own micro-batch, the last first, and each matmul as four
    quarters of its inputs, the last first); "fp32" (bf16 autocast's matmuls with their sums and
    output in fp32: ``model.Linear``)."""
    model = build(cfg, rules.one_device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    bf16, run = dtype == "bf16", Run([])
    linear = {"reversed": "split", "rows": "quarters", "fp32": "fp32"}.get(order, "plain")
    for step in range(1, steps + 1):
        X, Y = batches[step - 1]
        B = len(X)
        parts = {"reversed": [(B // 2, B), (0, B // 2)],
                 "rows": [(r, r + 1) for r in reversed(range(B))]}.get(order, [(0, B)])
        norm = rules.Norm(int((Y != -100).sum()), len(parts), 1)
        opt.zero_grad(set_to_none=True)
        total_all, tokens_all = 0.0, 0
        for a, b in parts:
            with at(step=step, rows=(a, B), seq=(0, cfg.seq), rule=rules.one_device,
                    seed=cfg.seed, p=cfg.p, linear=linear), \
                    torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                total, tokens = token_loss(model(X[a:b]), Y[a:b])
                value = loss(total, tokens, norm)
            value.backward()
            total_all, tokens_all = total_all + total.item(), tokens_all + tokens
        run.losses.append(total_all / tokens_all)
        if step in checks:
            run.grad_norms[step] = _norm({k: p.grad for k, p in model.named_parameters()})
            run.weights[step] = {k: p.detach().clone() for k, p in model.named_parameters()}
        opt.step()
    return run


def _norm(grads: dict) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values() if g is not None))


@dataclass
class Band:
    """Per step, how far a correct run may stray from the reference (loss); at the checked steps,
    for the gradient norm and the weights too. ``measured`` and ``floor`` hold, for "loss" (a list
    per step), "grad_norm" and "weights" (dicts by checked step), the largest difference so far
    between the reference and the reordered runs and one fp32 rounding unit of the value; each band
    is ``factor`` times the larger."""
    dtype: str
    reference: Run
    others: dict[str, Run]
    factor: float
    loss: list[float]
    grad_norm: dict[int, float]
    weights: dict[int, float]
    measured: dict = field(default_factory=dict)
    floor: dict = field(default_factory=dict)


def _spread(values: list[float]) -> list[float]:
    out, worst = [], 0.0
    for v in values:
        worst = max(worst, v)
        out.append(worst)
    return out


def measure_band(cfg: Config, batches, steps: int, checks=(), dtype: str = "fp32",
                 factor: float = FACTOR, lr: float = LR) -> Band:
    """Run the reference and the reordered (and, for bf16, fp32-summed) runs on one device; the
    band is ``factor`` times the larger of their largest difference so far and one fp32 rounding
    unit of the value, at each step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as each rank computes (bf16 on two busy threads: 40x slower here)
    try:
        ref = one_device(cfg, batches, steps, checks, dtype, "reference", lr)
        orders = ["reversed", "rows"] + (["fp32"] if dtype == "bf16" else [])
        others = {o: one_device(cfg, batches, steps, checks, dtype, o, lr) for o in orders}
    finally:
        torch.set_num_threads(threads)
    runs = others.values()
    measured = {"loss": _spread([max(abs(r.losses[k] - ref.losses[k]) for r in runs)
                                 for k in range(steps)]), "grad_norm": {}, "weights": {}}
    floor = {"loss": _spread([EPS32 * abs(v) for v in ref.losses[:steps]]), "grad_norm": {},
             "weights": {}}
    seen = {"grad_norm": [0.0, 0.0], "weights": [0.0, 0.0]}   # (measured, floor) so far
    for k in sorted(checks):
        size = math.sqrt(sum(float(v.double().pow(2).sum()) for v in ref.weights[k].values()))
        now = {"grad_norm": (max(abs(r.grad_norms[k] - ref.grad_norms[k]) for r in runs),
                             EPS32 * ref.grad_norms[k]),
               "weights": (max(_distance(r.weights[k], ref.weights[k]) for r in runs),
                           EPS32 * size)}
        for what, (m, f) in now.items():
            seen[what] = [max(seen[what][0], m), max(seen[what][1], f)]
            measured[what][k], floor[what][k] = seen[what]
    loss = [factor * max(m, f) for m, f in zip(measured["loss"], floor["loss"])]
    gn = {k: factor * max(measured["grad_norm"][k], floor["grad_norm"][k]) for k in checks}
    w = {k: factor * max(measured["weights"][k], floor["weights"][k]) for k in checks}
    return Band(dtype, ref, others, factor, loss, gn, w, measured, floor)


@dataclass
class Verdict:
    layout: Layout
    run: Run
    first: int | None          # the first step outside the band (None: within it)
    what: str = ""             # what left it first: loss, gradient norm, weights
    by: float = 0.0            # the difference there, in bands

    def line(self) -> str:
        """Deterministic for a given verdict: no measured number."""
        if self.first is None:
            return f"{self.layout.name}: within the band"
        return f"{self.layout.name}: outside the band from step {self.first} ({self.what})"

    def detail(self) -> str:
        if self.first is None:
            return f"{self.layout.name}: within the band (at most {self.by:.2f} of it)"
        return (f"{self.layout.name}: outside the band from step {self.first} ({self.what}, "
                f"{self.by:.2g} x the band)")


def judge(lay: Layout, run: Run, band: Band) -> Verdict:
    """The first step where the loss, the gradient norm or any rank's weights leave the band."""
    ref, worst = band.reference, 0.0
    for k in range(1, len(run.losses) + 1):
        found = [("loss", abs(run.losses[k - 1] - ref.losses[k - 1]) / band.loss[k - 1])]
        if k in run.grad_norms:
            found.append(("gradient norm", abs(run.grad_norms[k] - ref.grad_norms[k]) /
                          band.grad_norm[k]))
        if k in run.weights or k in run.copies:
            found.append(("weights", _weights_error(run, k, ref) / band.weights[k]))
        for what, by in found:
            if not by <= 1:    # NaN is outside too
                return Verdict(lay, run, k, what, by)
            worst = max(worst, by)
    return Verdict(lay, run, None, "", worst)


def _distance(weights: dict, ref: dict) -> float:
    """The Euclidean distance between two sets of weights (all of them as one vector)."""
    return math.sqrt(sum(float((weights[n].double() - v.double()).pow(2).sum())
                         for n, v in ref.items()))


def _weights_error(run: Run, k: int, ref: Run) -> float:
    """The largest distance from one device's of what one rank holds (its parts of the weights)."""
    worst, want = 0.0, ref.weights[k]
    every = run.copies.get(k) or [{n: (tuple(slice(0, m) for m in v.shape), v)
                                   for n, v in run.weights[k].items()}]
    for parts in every:
        squares = sum(float((t.double() - want[name][index].double()).pow(2).sum())
                      for name, (index, t) in parts.items())
        worst = max(worst, math.sqrt(squares))
    return worst


@dataclass
class Report:
    bands: dict[str, Band]
    verdicts: list[Verdict]

    def __getitem__(self, name: str) -> Verdict:
        for v in self.verdicts:
            if v.layout.name == name:
                return v
        raise KeyError(f"no layout named {name!r}: the report has "
                       f"{', '.join(v.layout.name for v in self.verdicts)}")

    def lines(self) -> list[str]:
        return [v.line() for v in self.verdicts]


def _worker(jobs, cfg, batches, steps, checks, lr):
    import torch.distributed as dist
    out = []
    for lay in jobs:
        if dist.get_rank() == 0:   # the launcher's progress line quotes it
            print(f"training {lay.name}", flush=True)
        train = train_course if lay.kind in ("hand", "ddp", "zero") else train_torch
        out.append(train(lay, cfg, batches, steps, checks, lr))
    return out


def _collect(lay: Layout, per_rank: list[dict], steps: int, checks) -> Run:
    """One layout's Run from every rank's results."""
    losses = []
    for k in range(steps):
        scored = [r["scored"][k] for r in per_rank if r["scored"][k] is not None]
        losses.append(sum(t for t, _ in scored) / max(sum(n for _, n in scored), 1))
    run = Run(losses)
    for k in checks:
        run.copies[k] = [r["parts"][k]["weights"] for r in per_rank]
        if per_rank[0]["parts"][k].get("grad_norm") is not None:   # ZeRO: measured on its shards
            run.grad_norms[k] = per_rank[0]["parts"][k]["grad_norm"]
            continue
        grads = {}
        for r in per_rank:   # the gradient, rebuilt from the ranks that hold each part
            for name, (index, g) in (r["parts"][k]["grads"] or {}).items():
                grads.setdefault(name, {})[tuple((s.start, s.stop) for s in index)] = g
        if grads:
            run.grad_norms[k] = math.sqrt(sum(float(g.double().pow(2).sum())
                                              for parts in grads.values() for g in parts.values()))
    return run


def _positive(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
        raise ValueError(f"{name}={v!r}: give a positive finite number")


def check_layouts(cfg: Config, batches, layouts: list[Layout], steps: int | None = None,
                  checks=None, factor: float = FACTOR, lr: float = LR, world: int | None = None,
                  bands: dict | None = None, timeout: float = 300.0, quiet: bool = True) -> Report:
    """Train each layout for ``steps`` steps on ``batches`` (a list of (X, Y), global batches) and
    compare it with one device against the band (see the module docstring).

    checks: the steps at which gradient norms and weights are compared (default: the first and the
    last); world: when given, every layout must use that many ranks; bands: measured bands to reuse
    (``report.bands``), by dtype; quiet: discard what the ranks print (False: print it after each
    launch). Every input is checked here, before any rank starts."""
    cfg.check()
    batches = list(batches)
    steps = len(batches) if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: give a whole number of steps, at least 1")
    if len(batches) < steps:
        raise ValueError(f"the data holds {len(batches)} batches, fewer than steps={steps}: make "
                         f"more batches or train fewer steps")
    checks = tuple(sorted(set(checks if checks is not None else (1, steps))))
    if any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= steps for k in checks):
        raise ValueError(f"checks={checks}: give steps between 1 and {steps}")
    _positive("factor (the band in measured spreads)", factor)
    _positive("lr", lr)
    if not layouts:
        raise ValueError("no layouts given: pass a list of Layout(...)")
    for i, (X, Y) in enumerate(batches[:steps]):
        if X.shape != Y.shape or X.dim() != 2 or X.shape[1] != cfg.seq:
            raise ValueError(f"batch {i} has inputs {tuple(X.shape)} and targets "
                             f"{tuple(Y.shape)}: give (rows, seq={cfg.seq}) for both")
        if int((Y != -100).sum()) == 0:
            raise ValueError(f"batch {i} has no real token to score: every target is padding")
    rows = min(len(X) for X, _ in batches[:steps])
    for lay in layouts:
        if world is not None and lay.world != world:
            raise ValueError(f"{lay.name}: dp x tp x pp x cp = {lay.world}, not the world size "
                             f"{world}: choose degrees whose product is {world}")
        check_layout(lay, cfg, rows)
    bands = dict(bands or {})
    for dtype in sorted({lay.dtype for lay in layouts} - set(bands)):
        bands[dtype] = measure_band(cfg, batches, steps, checks, dtype, factor, lr)
    by_world = defaultdict(list)
    for lay in layouts:
        by_world[lay.world].append(lay)
    runs = {}
    for n, jobs in by_world.items():
        print(f"{len(jobs)} layout(s) on {n} ranks, in one launch", flush=True)
        results = launch(_worker, n, jobs, cfg, batches[:steps], steps, checks, lr,
                         timeout=timeout, quiet=quiet)
        for j, lay in enumerate(jobs):
            runs[id(lay)] = _collect(lay, [r[j] for r in results], steps, checks)
    verdicts = [judge(lay, runs[id(lay)], bands[lay.dtype]) for lay in layouts]
    return Report(bands, verdicts)
