"""One layout's training on this rank, from the course's parts (``train_on_rank``; torch's API in
``torch_layouts``).

Every step, on every rank: read this rank's rows of the global batch (the layout's data rule) and,
with context parallelism, its positions; count the real tokens N of the whole global batch (every
rank can: it knows the batch and the data rule); run the forward and backward of each micro-batch
with the masks placed by ``model.at`` (step, rows, positions); backpropagate the loss rule's scalar;
finish the gradients (sequence-parallel partial sums over tp, the average over dp or cp); then
AdamW. At the checked steps, before the optimizer, each rank hands back its parts of the weights
and of the gradients, named as on one device with the slice it holds, so the caller can rebuild the
whole tensors and compare every rank's copy. ZeRO reduces its gradients inside its step, as shards:
there the norm of the reduced gradient is measured inside the step, on the shards, and summed over
the ranks (``zero_step_with_norm``).

Returned per step: the summed cross-entropy and the real tokens this rank scored (only the ranks
that compute the loss: the last pipeline stage, tensor rank 0), so the caller's loss is the mean
over the tokens the layout actually read.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from d2lpar.infra.adamw import AdamW
from d2lpar.infra.data import chunk_bounds
from d2lpar.strategies.agreement.layouts import Layout, global_tokens_of
from d2lpar.strategies.agreement.model import (Block, Config, Embed, Head, at, build, dropout, now,
                                               param_slices, token_loss)
from d2lpar.strategies.agreement.rules import Norm
from d2lpar.strategies.context.ring import ring_attention
from d2lpar.strategies.data.ddp import DDP
from d2lpar.strategies.pipeline.executor import run_schedule
from d2lpar.strategies.pipeline.schedules import one_f_one_b, split_layers
from d2lpar.strategies.sharded.mesh import Mesh
from d2lpar.strategies.sharded.zero import ZeroAdamW
from d2lpar.strategies.tensor.blocks import (ParallelLayerNorm, attention,
                                             sync_sequence_parallel_grads)
from d2lpar.strategies.tensor.layers import ColumnParallelLinear, RowParallelLinear
from d2lpar.strategies.tensor.mappings import gather_from_region, scatter_to_region
from d2lpar.strategies.threed.hand import average_gradients

__all__ = ["TPBlock", "CPBlock", "micro_loss", "zero_step_with_norm", "train_course", "LR"]

LR = 3e-3


class TPBlock(nn.Module):
    """``model.Block`` cut over ``group`` (Megatron's layer from the course's column/row layers):
    this rank keeps its heads and its part of the MLP's features; ``sp``: the residual stream and
    the LayerNorms hold s/t positions. Every dropout mask is placed where the tensor sits."""

    def __init__(self, block: Block, group, sp: bool):
        super().__init__()
        d, f = block.ln1.normalized_shape[0], block.fc1.out_features
        self.i, self.head_dim, self.sp, self.hidden = block.i, block.head_dim, sp, f
        self.k, self.t = dist.get_rank(group), dist.get_world_size(group)
        into, out_of = ("gather", "scatter") if sp else ("copy", "reduce")
        self.ln1 = ParallelLayerNorm(d, sp, block.ln1)
        self.qkv = ColumnParallelLinear(d, 3 * d, group=group, input_comm=into, full=block.qkv)
        self.out = RowParallelLinear(d, d, group=group, output_comm=out_of, full=block.out)
        self.ln2 = ParallelLayerNorm(d, sp, block.ln2)
        self.fc1 = ColumnParallelLinear(d, f, group=group, input_comm=into, full=block.fc1)
        self.fc2 = RowParallelLinear(f, d, group=group, output_comm=out_of, full=block.fc2)

    def forward(self, x):
        s0, S = now().seq
        resid = (s0 + self.k * x.shape[1], S) if self.sp else None   # this rank's positions
        x = x + dropout(self.out(attention(self.qkv(self.ln1(x)), self.head_dim, causal=True)),
                        f"{self.i}.attn", seq=resid)
        h = F.gelu(self.fc1(self.ln2(x)))
        h = dropout(h, f"{self.i}.hidden", feature=(self.k * h.shape[-1], self.hidden))
        return x + dropout(self.fc2(h), f"{self.i}.mlp", seq=resid)


class CPBlock(Block):
    """``model.Block`` whose attention is ring attention over the world (context parallelism): the
    queries of this rank's positions against every position, causal. In fp32 whatever the autocast,
    as flash attention accumulates its softmax in fp32."""

    def __init__(self, block: Block, cfg: Config):
        super().__init__(cfg, block.i)
        self.load_state_dict(block.state_dict())

    def attend(self, qkv):
        b, s, _ = qkv.shape
        with torch.autocast("cpu", enabled=False):
            q, k, v = qkv.float().view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
            o = ring_attention(q, k, v, causal=True)
        return o.transpose(1, 2).reshape(b, s, -1).to(qkv.dtype)


class _Then(nn.Module):
    """``inner`` then ``after`` (a sequence-parallel scatter or gather): named as ``inner``."""

    def __init__(self, inner: nn.Module, before=None, after=None):
        super().__init__()
        self.inner, self.before, self.after = inner, before, after

    def forward(self, x):
        x = self.before(x) if self.before else x
        x = self.inner(x)
        return self.after(x) if self.after else x


class _Rows(nn.Module):
    """A pipeline stage that knows which rows each forward's micro-batch holds (``queue``: the
    row offsets of this rank's forwards, in the order the schedule runs them), under autocast."""

    def __init__(self, stage: nn.Module, bf16: bool):
        super().__init__()
        self.stage, self.bf16, self.queue = stage, bf16, []

    def forward(self, x):
        with at(rows=(self.queue.pop(0), now().rows[1])), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            return self.stage(x)


def _parts(named, full: dict, tp: int, k: int, grads: bool) -> dict:
    """{one-device name: (index, tensor)} of this rank's parameters (or their gradients)."""
    out = {}
    for name, p in named:
        t = p.grad if grads else p.detach()
        if t is None:
            continue
        index, _ = param_slices(name, tuple(full[name].shape), tp, k)
        out[name] = (index, t.detach().clone().float())
    return out


def _named(placed: list[tuple[int, nn.Module]]):
    for i, m in placed:
        inner = m.inner if isinstance(m, _Then) else m
        for n, p in inner.named_parameters():
            yield f"{i}.{n}", p


def micro_loss(lay: Layout, norm: Norm, mine: list, logits, targets, share: float = 1.0):
    """The scalar one micro-batch backpropagates: the layout's loss rule applied to its summed
    cross-entropy and its real tokens (``mine`` adds both up, for the loss the layout reports).
    ``share``: the pipeline executor multiplies each micro-batch's loss by its share of the rows
    (right for a mean per row); dividing by it here leaves each token's weight to the rule alone."""
    total, tokens = token_loss(logits, targets)
    mine[0] += total.item()
    mine[1] += tokens
    return lay.loss(total, tokens, norm) / share


def zero_step_with_norm(opt: ZeroAdamW) -> float:
    """``opt.step()``, returning the norm of the whole gradient it applied: inside the step, after
    the reduce-scatter and the division by the ranks, before AdamW, each rank's squares of its
    shards (the pieces AdamW steps), then summed over the ranks in one all-reduce."""
    inner, squares = opt.opt.step, []

    def measured():
        squares.append(sum(float(seg.grad.double().pow(2).sum()) for u in opt.units
                           for seg, _, _ in u.segments if seg.grad is not None))
        inner()

    opt.opt.step = measured
    try:
        opt.step()
    finally:
        del opt.opt.step   # the class's step again
    total = torch.tensor(squares, dtype=torch.float64)
    dist.all_reduce(total)
    return math.sqrt(float(total))


def train_course(lay: Layout, cfg: Config, batches, steps: int, checks: tuple,
                 lr: float = LR) -> dict:
    """Train ``lay`` (kind hand, ddp or zero) for ``steps`` steps on this rank (inside a launched
    rank); see the module docstring."""
    dp, pp, cp, tp = lay.dp, lay.pp, lay.cp, lay.tp
    mesh = Mesh((dp, pp, cp, tp), ("dp", "pp", "cp", "tp"))
    di, pi, ci, ti = mesh.coords
    coords = {"dp": di, "pp": pi, "cp": ci, "tp": ti}
    full = build(cfg, lay.init, coords, tp)          # this rank's view: its slices drawn, rest 0
    shapes_full = dict(full.named_parameters())
    lo, hi = split_layers(len(full), pp)[pi]
    tp_group = mesh.group("tp")
    placed = []
    for i in range(lo, hi):
        layer = full[i]
        if isinstance(layer, Block) and tp > 1:
            layer = TPBlock(layer, tp_group, lay.sp)
        elif isinstance(layer, Block) and cp > 1:
            layer = CPBlock(layer, cfg)
        elif isinstance(layer, Embed) and lay.sp:
            layer = _Then(layer, after=lambda x: scatter_to_region(x, 1, tp_group))
        elif isinstance(layer, Head) and lay.sp:
            layer = _Then(layer, before=lambda x: gather_from_region(x, 1, tp_group))
        placed.append((i, layer))
    stage = nn.Sequential(*[m for _, m in placed])
    named = list(_named(placed))
    if lay.kind == "ddp":
        runner = DDP(stage)
        opt = torch.optim.AdamW(stage.parameters(), lr=lr)
    elif lay.kind == "zero":
        runner = stage
        opt = ZeroAdamW(stage, lay.zero, lr=lr)
    else:
        runner = stage
        opt = torch.optim.AdamW(stage.parameters(), lr=lr)
    bf16 = lay.dtype == "bf16"
    m = lay.microbatches
    schedule = one_f_one_b(pp, m) if pp > 1 else None
    if schedule is not None:
        piped = _Rows(stage, bf16)
        forwards = [a.mb for a in schedule.order[pi] if a is not None and a.kind == "F"]
    S = cfg.seq
    s0, s1 = ci * S // cp, (ci + 1) * S // cp
    scored, out_parts = [], {}
    for step in range(1, steps + 1):
        X, Y = batches[step - 1]
        B = len(X)
        a, b = lay.data(B, dp, di)
        Xr, Yr = X[a:b, s0:s1], Y[a:b, s0:s1]
        norm = Norm(global_tokens_of(lay, Y), m, dp * cp)
        mine = [0.0, 0]
        loss_of = functools.partial(micro_loss, lay, norm, mine)

        if lay.kind == "zero":
            opt.zero_grad()
        else:
            for p in stage.parameters():
                p.grad = None
        with at(step=step, rows=(a, B), seq=(s0, S), coords=coords, rule=lay.dropout,
                seed=cfg.seed, p=cfg.p):
            if schedule is not None:
                bounds = chunk_bounds(len(Xr), m)
                piped.queue = [a + bounds[k][0] for k in forwards]
                shapes = _pipeline_shapes(pp, bounds, s1 - s0, cfg, tp if lay.sp else 1)
                run_schedule(schedule, {pi: piped}, Xr, Yr,
                             lambda out, tgt: loss_of(out, tgt, len(tgt) / len(Xr)), shapes,
                             ranks=mesh.ranks("pp"))
            else:
                for lo_, hi_ in chunk_bounds(len(Xr), m):
                    with at(rows=(a + lo_, B)), \
                            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        logits = runner(Xr[lo_:hi_])
                        loss = loss_of(logits, Yr[lo_:hi_])
                    loss.backward()
        if lay.sp:
            sync_sequence_parallel_grads(stage, tp_group)
        if lay.kind == "hand" and dp * cp > 1:
            average_gradients(stage, mesh.group("dp") if dp > 1 else mesh.group("cp"))
        if step in checks:
            if lay.kind == "zero":
                state = opt.full_state_dict()   # a collective with stage 3
                out_parts[step] = {"weights": {k: (tuple(slice(0, n) for n in v.shape), v.float())
                                               for k, v in state.items()}, "grads": None,
                                   "grad_norm": zero_step_with_norm(opt)}
            else:
                out_parts[step] = {"weights": _parts(named, shapes_full, tp, ti, False),
                                   "grads": _parts(named, shapes_full, tp, ti, True)}
        if not (step in checks and lay.kind == "zero"):   # ZeRO's checked steps stepped above
            opt.step()
        last = pi == pp - 1 and ti == 0
        scored.append(tuple(mine) if last else None)
    return {"scored": scored, "parts": out_parts, "coords": coords}


def _pipeline_shapes(pp: int, bounds, positions: int, cfg: Config, sp: int) -> list:
    """The messages between stages, per stage and micro-batch: every stage but the last sends the
    residual stream, (rows, positions / sp, d) in fp32 (under autocast too: the residual adds
    fp32); the last stage's entry is not read (it sends nothing)."""
    out = []
    for s in range(pp):
        width, n = (cfg.d, positions // sp) if s < pp - 1 else (cfg.vocab, positions)
        out.append([((hi - lo, n, width), torch.float32) for lo, hi in bounds])
    return out
