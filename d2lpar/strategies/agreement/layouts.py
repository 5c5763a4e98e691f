"""A layout: how the GPT of ``model.py`` is cut over ranks, by whose code, and with which rules.

``Layout(kind, dp, tp, pp, cp, ...)`` names one way to train; the checker runs it and compares it
with one device. The kinds, each running on ``dp x tp x pp x cp`` ranks:

    hand                 the course's own parts on a grid arange(world).view(dp, pp, cp, tp):
                         Megatron's layers over tp (``sp=True``: sequence parallel), the 1F1B
                         executor over pp, ring attention over cp (alone: it rings the world),
                         gradients averaged over dp in one flat all-reduce
    ddp                  the course's DDP (buckets, hooks) over dp
    zero                 the course's ZeroAdamW, ``zero=1, 2 or 3``, over dp
    torch-ddp            torch.nn.parallel.DistributedDataParallel over dp
    fully_shard          FSDP2: ``fully_shard`` on every block, then on the model, over dp
    parallelize_module   torch's ColwiseParallel / RowwiseParallel on every block over tp

``microbatches``: per data-parallel rank and step (the pipeline's m; without a pipeline, gradient
accumulation). ``dtype``: "fp32" or "bf16" (matmuls under CPU autocast, weights and optimizer in
fp32, as torch.autocast does). ``init``, ``dropout``, ``loss``, ``data``: the rules of
``rules.py``; planting a broken one is how notebook 18 shows a silent divergence.
``check_layout`` says in one sentence what cannot run, before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from d2lpar.strategies.agreement import rules
from d2lpar.strategies.agreement.model import IGNORE, Config

__all__ = ["KINDS", "Layout", "check_layout", "global_tokens_of"]

KINDS = ("hand", "ddp", "zero", "torch-ddp", "fully_shard", "parallelize_module")
_ONLY = {"ddp": "dp", "zero": "dp", "torch-ddp": "dp", "fully_shard": "dp",
         "parallelize_module": "tp"}


@dataclass(frozen=True)
class Layout:
    kind: str = "hand"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: bool = False
    zero: int = 0
    microbatches: int = 1
    dtype: str = "fp32"
    init: Callable = rules.one_device
    dropout: Callable = rules.one_device
    loss: Callable = rules.global_tokens
    data: Callable = rules.own_rows
    label: str = ""

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        dims = [f"{k} {v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp),
                                         ("cp", self.cp)) if v > 1] or ["1 rank"]
        what = {"hand": "", "ddp": "DDP (course) ", "zero": f"ZeRO-{self.zero} ",
                "torch-ddp": "torch DDP ", "fully_shard": "fully_shard ",
                "parallelize_module": "parallelize_module "}.get(self.kind, self.kind + " ")
        extra = (" + sp" if self.sp else "") + (f", m {self.microbatches}"
                                                if self.microbatches > 1 else "")
        return f"{what}{' x '.join(dims)}{extra}" + (", bf16" if self.dtype == "bf16" else "")


def _positive(name: str, v) -> None:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise ValueError(f"{name}={v!r}: give a whole number of at least 1")


def check_layout(lay: Layout, cfg: Config, batch_rows: int) -> None:
    """One sentence for the first thing that stops ``lay`` from training ``cfg`` on batches of
    ``batch_rows`` rows: an unknown kind, a degree that is not a positive number, a split the
    model cannot take (heads, widths, layers, sequence), a batch too small for its ranks."""
    if lay.kind not in KINDS:
        raise ValueError(f"kind={lay.kind!r}: use one of {', '.join(KINDS)}")
    for k in ("dp", "tp", "pp", "cp", "microbatches"):
        _positive(f"{lay.name}: {k}", getattr(lay, k))
    if lay.dtype not in ("fp32", "bf16"):
        raise ValueError(f"{lay.name}: dtype={lay.dtype!r}: use 'fp32' or 'bf16'")
    for k in ("init", "dropout", "loss", "data"):
        if not callable(getattr(lay, k)):
            raise ValueError(f"{lay.name}: {k}={getattr(lay, k)!r} is not a function: give a rule "
                             f"as in d2lpar.strategies.agreement.rules")
    only = _ONLY.get(lay.kind)
    if only:
        others = [k for k in ("dp", "tp", "pp", "cp") if k != only and getattr(lay, k) > 1]
        if others or lay.sp:
            raise ValueError(f"{lay.name}: kind {lay.kind!r} splits over {only} only, not "
                             f"{', '.join(others) or 'the sequence (sp)'}: use kind='hand' to "
                             f"combine degrees")
        if lay.microbatches > 1:
            raise ValueError(f"{lay.name}: kind {lay.kind!r} runs one micro-batch per step: use "
                             f"kind='hand' for micro-batches")
    if lay.kind == "zero" and lay.zero not in (1, 2, 3):
        raise ValueError(f"{lay.name}: zero={lay.zero!r}: ZeRO's stage is 1, 2 or 3")
    if lay.kind != "zero" and lay.zero:
        raise ValueError(f"{lay.name}: zero={lay.zero} needs kind='zero'")
    if lay.cp > 1 and lay.world != lay.cp:
        raise ValueError(f"{lay.name}: ring attention passes its blocks round every rank, so "
                         f"context parallelism runs alone: use dp = tp = pp = 1 with cp > 1")
    tp = lay.tp
    for what, n in (("heads", cfg.heads), ("hidden", cfg.hidden)):
        if n % tp:
            raise ValueError(f"{lay.name}: tensor degree {tp} does not divide {what}={n}: choose a "
                             f"tp that divides the heads and the MLP's width")
    if lay.sp and tp == 1:
        raise ValueError(f"{lay.name}: sp=True cuts the sequence over the tensor ranks: it needs "
                         f"tp > 1")
    if lay.sp and cfg.seq % tp:
        raise ValueError(f"{lay.name}: sequence parallelism cuts seq={cfg.seq} over tp={tp}: "
                         f"choose a seq that tp divides")
    if cfg.seq % lay.cp:
        raise ValueError(f"{lay.name}: context parallelism cuts seq={cfg.seq} over cp={lay.cp}: "
                         f"choose a seq that cp divides")
    if lay.pp > cfg.layers + 2:
        raise ValueError(f"{lay.name}: pipeline degree {lay.pp} is more than the model's "
                         f"{cfg.layers + 2} layers (embedding, {cfg.layers} blocks, head): use "
                         f"pp <= {cfg.layers + 2}")
    need = lay.dp * lay.microbatches
    if batch_rows < need:
        raise ValueError(f"{lay.name}: a global batch of {batch_rows} rows gives its {lay.dp} "
                         f"data-parallel rank(s) fewer than {lay.microbatches} row(s) each: use "
                         f"batches of at least {need} rows (or fewer micro-batches)")


def global_tokens_of(lay: Layout, Y: torch.Tensor) -> int:
    """Real tokens in every data-parallel rank's rows of the global batch, as the data rule gives
    them: each rank can count them without a message, since each knows the batch and the rule."""
    return sum(int((Y[a:b] != IGNORE).sum()) for a, b in
               (lay.data(len(Y), lay.dp, r) for r in range(lay.dp)))
