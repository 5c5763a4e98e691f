"""Data x tensor x pipeline parallelism by hand, from the course's own parts.

The world's ranks form a grid ``arange(world).view(dp, pp, tp)`` (``sharded.mesh.Mesh``): tensor
parallelism innermost, on neighbouring ranks (the fast links of one node); each rank has three
groups, the lines of the grid through it. One training step, on every rank:

1. **data**: the rank takes the rows of the global batch of its dp coordinate (each batch cut by
   its own size, ``chunk_bounds``: a batch of 7 on dp=3 gives 3, 2 and 2 rows);
2. **pipeline**: it runs stage ``pp coordinate`` of the model (``split_model``) in the 1F1B schedule
   of notebook 11 (``run_schedule``), sending activations and gradients to the ranks of its pp group;
3. **tensor**: inside the stage, each transformer layer is Megatron's (notebook 12), cut over the tp
   group: 2 all-reduces forward, 2 backward. The embedding and the head stay whole on each tp rank:
   they see the same input and the same gradient, so their gradients agree without a message;
4. **data again**: after the schedule, the gradients are averaged over the dp group in one flat
   all-reduce (notebook 05's rule: average, then step), and each rank steps AdamW on what it holds.
   A rank's gradient is the mean over its n_r of the batch's B rows, so it is first scaled by
   n_r dp / B: the average is then sum_r (n_r / B) g_r, the whole batch's mean (1 when the rows
   split evenly).

The first step's gradients, averaged and before the optimizer, come back whole (``grads``): AdamW's
update m / (sqrt(v) + eps) barely changes when every gradient is scaled by the same factor, so
a weights check after AdamW steps is fragile against a sum in place of a mean (it catches it only
at a tight enough tolerance); a gradient check catches it by a factor of two.

Each rank holds 1/(tp pp) of the model's transformer weights; every message is real. With
``rate``, each layer also waits its FLOPs / rate in forward and twice that in backward
(``infra.device_time.Busy``): a simulated device, so that 8 ranks on 2 cores time as 8 devices would.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from d2lpar.infra.data import chunk_bounds
from d2lpar.infra.device_time import Busy
from d2lpar.infra.timing import Span, Timeline
from d2lpar.processes.launch import launch
from d2lpar.strategies.pipeline.executor import check_stages, run_schedule, split_model
from d2lpar.strategies.pipeline.schedules import one_f_one_b, split_layers
from d2lpar.strategies.sharded.mesh import Mesh, grid
from d2lpar.strategies.tensor.blocks import ParallelTransformerLayer, TransformerLayer, gather_full
from d2lpar.strategies.tensor.mappings import count_comms
from d2lpar.strategies.threed.gpt import Head, gpt_sizes, next_char_loss

__all__ = ["check_3d", "batch_shapes", "parallel_stage", "average_gradients", "run_3d",
           "ThreeDResult", "forward_flops", "time_layouts"]


def check_3d(model: nn.Sequential, shape: tuple[int, int, int], batch: int | None,
             microbatches: int) -> None:
    """One sentence per layout that cannot run this model on this batch (None: the layout only)."""
    dp, pp, tp = shape
    if min(shape) < 1:
        raise ValueError(f"dp x pp x tp = {shape}: every degree must be at least 1")
    size = gpt_sizes(model)
    for name in ("heads", "d", "hidden"):
        if size[name] % tp:
            raise ValueError(f"tensor degree {tp} does not divide {name}={size[name]}: choose a tp "
                             f"that divides the heads, the width and the MLP's width")
    if pp > size["layers"] + 2:
        raise ValueError(f"pipeline degree {pp} is more than the model's {size['layers'] + 2} layers "
                         f"(embedding, {size['layers']} transformer layers, head): use pp <= {size['layers'] + 2}")
    if batch is not None and batch < dp * microbatches:
        raise ValueError(f"a batch of {batch} rows gives dp={dp} ranks fewer than {microbatches} "
                         f"micro-batches each: use batches of at least {dp * microbatches} rows "
                         f"(or fewer micro-batches)")


def batch_shapes(model: nn.Sequential, shape: tuple[int, int, int], batches,
                 microbatches: int) -> list[list[list[tuple]]]:
    """Check every batch, in the caller, before any rank starts; per batch and dp coordinate, the
    pipeline's message shapes (``check_stages`` on that rank's rows: a later batch may be shorter
    or longer than the first, and its messages must be sized from it)."""
    dp, pp, _ = shape
    check_3d(model, shape, None, microbatches)
    stages, seen, out = split_model(model, pp), {}, []
    for i, (X, Y) in enumerate(batches):
        if X.shape != Y.shape:
            raise ValueError(f"batch {i} has inputs of shape {tuple(X.shape)} and targets of shape "
                             f"{tuple(Y.shape)}: give each token its next token (Y shaped as X)")
        try:
            check_3d(model, shape, len(X), microbatches)
            per_rank = []
            for lo, hi in chunk_bounds(len(X), dp):
                key = (hi - lo, tuple(X.shape[1:]), X.dtype)
                if key not in seen:
                    seen[key] = check_stages(stages, X[lo:hi], microbatches)
                per_rank.append(seen[key])
        except ValueError as e:
            raise ValueError(f"batch {i}: {e}") from None
        out.append(per_rank)
    return out


def forward_flops(layer: nn.Module, tp: int, x: torch.Tensor) -> float:
    """Forward FLOPs of one of the GPT's layers on input ``x``, per tp rank (matmuls only; the head's
    product 2 b s d V; the embedding's lookup: none)."""
    b, s = x.shape[:2]
    if isinstance(layer, (TransformerLayer, ParallelTransformerLayer)):
        d, f = layer.ln1.normalized_shape[0], layer.mlp.fc1.out_features
        # QKV and output (8 b s d^2), scores and their use (4 b s^2 d), the MLP (4 b s d f): the
        # planner's tp_cost.layer_flops (a test keeps the two equal; strategies sit below cost)
        return (8 * b * s * d * d + 4 * b * s * s * d + 4 * b * s * d * f) / tp
    if isinstance(layer, Head):
        return 2 * b * s * layer.out.in_features * layer.out.out_features
    return 0.0


def parallel_stage(stage: nn.Sequential, tp_group, rate: float | None = None) -> nn.Sequential:
    """The stage with each transformer layer cut over ``tp_group`` (Megatron's layer, built from
    the single-device one: this rank keeps its heads and its part of the MLP); the other layers whole.
    With ``rate``, every layer computes on a simulated device of that many FLOP/s."""
    tp = dist.get_world_size(tp_group)
    layers = []
    for layer in stage:
        if isinstance(layer, TransformerLayer):
            d = layer.ln1.normalized_shape[0]
            layer = ParallelTransformerLayer(d, d // layer.attn.head_dim, layer.mlp.fc1.out_features,
                                             group=tp_group, full=layer)
        else:
            layer = copy.deepcopy(layer)
        if rate:
            layer = Busy(layer, functools.partial(forward_flops, layer, tp), rate)
        layers.append(layer)
    return nn.Sequential(*layers)


def average_gradients(module: nn.Module, group) -> int:
    """Average every gradient over the data-parallel group in one flat all-reduce; bytes sent in."""
    n = dist.get_world_size(group)
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if n == 1 or not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= n
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
    return flat.numel() * flat.element_size()


def _rename(part: dict, lo: int, busy: bool) -> dict:
    """Stage-local names -> the model's ("0.layer.x" under Busy -> "x")."""
    out = {}
    for k, v in part.items():
        i, rest = k.split(".", 1)
        out[f"{lo + int(i)}.{rest.removeprefix('layer.') if busy else rest}"] = v
    return out


def _worker(model, shape, batches, shapes, lr, microbatches, rate, warmup, gather,
            average=average_gradients):
    dp, pp, tp = shape
    mesh = Mesh((dp, pp, tp), ("dp", "pp", "tp"))
    di, pi, ti = mesh.coords
    stage = parallel_stage(split_model(model, pp)[pi], mesh.group("tp"), rate)
    schedule = one_f_one_b(pp, microbatches)
    opt = torch.optim.AdamW(stage.parameters(), lr=lr)
    rows = []   # this rank's rows of each batch, their message shapes, their weight n_r dp / B
    for (X, Y), per_rank in zip(batches, shapes):
        a, b = chunk_bounds(len(X), dp)[di]
        rows.append((X[a:b], Y[a:b], per_rank[di], (b - a) * dp / len(X)))
    lo, _ = split_layers(len(model), pp)[pi]
    losses, steps, grads = [], [], None
    for step, (X, Y, mb_shapes, weight) in enumerate([rows[0]] * warmup + rows):
        opt.zero_grad(set_to_none=True)
        dist.barrier()   # every rank starts the step together
        t0 = time.perf_counter()
        with count_comms() as log:
            out = run_schedule(schedule, {pi: stage}, X, Y, next_char_loss, mb_shapes,
                               ranks=mesh.ranks("pp"))
        t1 = time.perf_counter()
        if weight != 1:   # fewer or more rows than the others: weigh its mean by its rows
            for p in stage.parameters():
                if p.grad is not None:
                    p.grad *= weight
        sent = average(stage, mesh.group("dp"))
        if gather and step == warmup:   # the first step's averaged gradients, before AdamW sees them
            grads = _rename(gather_full(stage, grads=True, group=mesh.group("tp")), lo, bool(rate))
        opt.step()
        t2 = time.perf_counter()
        if step >= warmup:
            losses.append(out["loss"])
            steps.append({"spans": out["spans"], "comms": [(c.start, c.end) for c in log.comms],
                          "start": t0, "schedule_end": t1, "end": t2, "dp_bytes": sent})
    state = None
    if gather:   # a collective over tp
        state = _rename(gather_full(stage, group=mesh.group("tp")), lo, bool(rate))
    keep = di == 0 and ti == 0
    return {"coords": mesh.coords, "groups": {n: mesh.ranks(n) for n in ("dp", "pp", "tp")},
            "losses": losses, "steps": steps, "state": state, "keep": keep,
            "grads": grads if keep else None}


@dataclass
class ThreeDResult:
    shape: tuple[int, int, int]
    losses: list[float]              # per step, the global batch's mean loss
    state: dict[str, torch.Tensor]   # the model's state dict after the last step, rebuilt from the parts
    groups: list[dict]               # per rank, its grid coordinates and the ranks of its three groups
    timeline: Timeline               # the last step: 1F1B actions and tensor-parallel all-reduces per rank
    step_times: list[float]          # per step, the slowest rank's seconds (barrier to optimizer step)
    grads: dict[str, torch.Tensor] | None = None   # the first step's averaged gradients, before AdamW
    copies_differ: float | None = None   # the largest difference of any rank's copy from ``state``

    def grid_text(self) -> str:
        dp, pp, tp = self.shape
        return str(grid(dp * pp * tp, self.shape).tolist())


def run_3d(model: nn.Sequential, batches, dp: int = 2, tp: int = 2, pp: int = 2, lr: float = 3e-3,
           microbatches: int = 2, rate: float | None = None, warmup: int = 0, gather: bool = True,
           timeout: float = 120.0, average=average_gradients) -> ThreeDResult:
    """Train ``model`` (a ``char_gpt``) on ``batches`` on dp x tp x pp ranks (grid (dp, pp, tp)); the
    caller's model is not changed. ``rate``: simulate devices of that many FLOP/s (for timing).
    ``average(module, group)``: how the dp gradients are combined (a planted bug can replace it)."""
    batches, shape = list(batches), (dp, pp, tp)
    if not batches:
        raise ValueError("run_3d got no batches: give a list of (X, Y) pairs")
    shapes = batch_shapes(model, shape, batches, microbatches)   # every batch, before any rank
    results = launch(_worker, math.prod(shape), model, tuple(shape), batches, shapes, lr,
                     microbatches, rate, warmup, gather, average, timeout=timeout)
    state, grads = {}, {}
    for r in results:
        if r["keep"]:
            state.update(r["state"] or {})
            grads.update(r["grads"] or {})
    copies_differ = max((float((v - state[k]).abs().max()) for r in results
                         for k, v in (r["state"] or {}).items()), default=None)
    last_pp = [r for r in results if r["coords"][1] == shape[1] - 1 and r["coords"][2] == 0]
    losses = []   # each dp rank's mean loss, weighted by its share of the batch's rows
    for k, (X, _) in enumerate(batches):
        bounds = chunk_bounds(len(X), shape[0])
        losses.append(sum(r["losses"][k] * (bounds[r["coords"][0]][1] - bounds[r["coords"][0]][0])
                          for r in last_pp) / len(X))
    spans = []
    for rank, r in enumerate(results):
        last = r["steps"][-1]
        spans += [Span(*sp) for sp in last["spans"]]
        spans += [Span(f"rank {rank}", "all-reduce", a, b) for a, b in last["comms"]]
        spans.append(Span(f"rank {rank}", "dp average + step", last["schedule_end"], last["end"]))
    steps = [max(r["steps"][k]["end"] for r in results) - min(r["steps"][k]["start"] for r in results)
             for k in range(len(batches))]
    groups = [{"rank": i, "coords": r["coords"], **r["groups"]} for i, r in enumerate(results)]
    return ThreeDResult(tuple(shape), losses, state, groups, Timeline(spans), steps, grads or None,
                        copies_differ)


def _layouts_worker(model, shapes, batches, sizes, microbatches, rate, warmup):
    return [[(st["start"], st["end"]) for st in
             _worker(model, shape, batches, size, 0.0, microbatches, rate, warmup, False)["steps"]]
            for shape, size in zip(shapes, sizes)]


def time_layouts(model: nn.Sequential, batches, layouts, microbatches: int = 4, rate: float = 2e9,
                 warmup: int = 1, timeout: float = 300.0) -> list[float]:
    """Seconds per step of each (dp, tp, pp) layout on simulated devices of ``rate`` FLOP/s, all in
    one launch of 8 ranks (one Mesh per layout): per layout, the median over the steps of the slowest
    rank's time from the barrier to the optimizer step."""
    world, batches = math.prod(layouts[0]), list(batches)
    shapes, sizes = [], []
    for dp, tp, pp in layouts:
        if dp * tp * pp != world:
            raise ValueError(f"layout dp {dp} x tp {tp} x pp {pp} is not {world} ranks: give layouts "
                             f"of the same world size")
        shapes.append((dp, pp, tp))
        sizes.append(batch_shapes(model, shapes[-1], batches, microbatches))
    results = launch(_layouts_worker, world, model, shapes, batches, sizes, microbatches, rate,
                     warmup, timeout=timeout)
    times = []
    for k in range(len(shapes)):   # per step: the last rank's end minus the first rank's start
        per_step = sorted(max(r[k][i][1] for r in results) - min(r[k][i][0] for r in results)
                          for i in range(len(batches)))
        times.append(per_step[len(per_step) // 2])
    return times
