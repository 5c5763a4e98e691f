"""A layout: how a training step is cut over the GPUs, what it keeps and how it schedules, in one
object the planner prices and the command line reads (``dp=16,tp=8,pp=8,zero=1,micro=96,...``).

Degrees: data (dp), tensor (tp), pipeline (pp) and context (cp) parallelism, dp tp pp cp = the GPUs.
Levers: ZeRO stage 0-3 over the dp cp ranks that hold the same parameters (``keep``: ZeRO-3 gathers
each step's parameters once and keeps them, as Llama 3 did, instead of in every micro-batch, and
reduce-scatters the gradients once, after the last micro-batch), the
micro-batches per step (``micro``: each of batch / (dp micro) sequences), activation checkpointing
(``transformer.CHECKPOINTS``), sequence parallelism (``sp``, Korthikanti et al. 2022: the norms'
and dropouts' activations cut over the tensor ranks), the pipeline's schedule (1F1B, interleaved
with ``v`` stages per GPU, ZB-H1, GPipe: ``d2lpar.cost.bubble``), the embedding and loss cut over
the tensor ranks (``vocab_parallel``, Megatron-LM's vocabulary-parallel layers), the context
parallelism's kind (``cp_kind``: an all-gather of the keys and values, as Llama 3, or a ring,
notebook 15) and the rank order (``cluster.ORDERS``).
"""

from __future__ import annotations

from dataclasses import dataclass

from d2lpar.cost.cluster import ORDERS, Cluster, check_order
from d2lpar.cost.transformer import CHECKPOINTS, Model

__all__ = ["Layout", "SCHEDULES", "CP_KINDS", "check_layout", "parse_layout", "LAYOUT_KEYS"]

SCHEDULES = ("1F1B", "interleaved", "ZB-H1", "GPipe")
CP_KINDS = ("all-gather", "ring")


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: int = 1
    micro: int = 1                 # micro-batches per step (per data-parallel rank)
    checkpoint: str = "none"
    cp: int = 1
    sp: bool = False
    schedule: str = "1F1B"
    v: int = 1                     # stages per GPU of the interleaved schedule
    keep: bool = False             # ZeRO-3: the step's gathered parameters kept
    vocab_parallel: bool = False   # embedding, output layer and loss cut over the tensor ranks
    order: str = ORDERS[0]
    cp_kind: str = "all-gather"

    def __str__(self) -> str:
        deg = f"dp {self.dp} x tp {self.tp} x pp {self.pp}" + (f" x cp {self.cp}" if self.cp > 1
                                                              else "")
        zero = f"ZeRO-{self.zero}" + (" (kept)" if self.keep else "")
        extra = "".join([", sequence parallel" if self.sp else "",
                         f", {self.schedule_name}" if self.pp > 1 else ""])
        return (f"{deg}, {zero}, {self.micro} micro-batches, checkpointing {self.checkpoint}"
                f"{extra}").replace(", sequence parallel", ", SP").replace("interleaved 1F1B",
                                                                           "interleaved")

    @property
    def schedule_name(self) -> str:
        return f"interleaved 1F1B (v={self.v})" if self.schedule == "interleaved" else self.schedule

    def spec(self) -> str:
        """The layout as ``--layout`` reads it (keys at their command-line default left out)."""
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        parts += [f"cp={self.cp}"] if self.cp > 1 else []
        parts += ["sp=1"] if self.sp else []
        parts += [f"zero={self.zero}"] + (["keep=1"] if self.keep else [])
        parts += [f"micro={self.micro}", f"checkpoint={self.checkpoint}"]
        if self.pp > 1:
            parts += [f"schedule=interleaved:{self.v}" if self.schedule == "interleaved"
                      else f"schedule={self.schedule}"]
        parts += [] if self.vocab_parallel else ["vocab=0"]
        parts += [] if self.order == ORDERS[0] else [f"order={self.order}"]
        parts += [f"cp-kind={self.cp_kind}"] if self.cp > 1 and self.cp_kind != CP_KINDS[0] else []
        return ",".join(parts)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def check_layout(model: Model, cluster: Cluster, lay: Layout) -> None:
    """One sentence per impossible layout (the planner never proposes one)."""
    for name in ("dp", "tp", "pp", "cp", "micro", "v"):
        v = getattr(lay, name)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"layout: {name}={v!r} must be a positive whole number")
    if lay.gpus != cluster.gpus:
        cp = f" x cp {lay.cp}" if lay.cp > 1 else ""
        raise ValueError(f"dp x tp x pp = {lay.dp} x {lay.tp} x {lay.pp}{cp} = {lay.gpus}, not the "
                         f"cluster's {cluster.gpus} GPUs")
    for name, size in (("heads", model.heads), ("kv_heads", model.kv), ("d", model.d),
                       ("hidden", model.f)):
        if size % lay.tp:
            raise ValueError(f"tensor degree {lay.tp} does not divide {name}={size}")
    if lay.pp > model.layers:
        raise ValueError(f"pipeline degree {lay.pp} is more than the {model.layers} layers")
    if lay.cp > 1 and model.seq % (2 * lay.cp):
        raise ValueError(f"context degree {lay.cp} does not cut the sequence of {model.seq} into "
                         f"2 x {lay.cp} equal chunks (the causal mask's balanced split)")
    if model.batch % (lay.dp * lay.micro):
        raise ValueError(f"the global batch of {model.batch} does not cut into dp {lay.dp} x "
                         f"{lay.micro} micro-batches")
    if lay.zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={lay.zero!r}: use a ZeRO stage 0, 1, 2 or 3")
    if lay.keep and lay.zero != 3:
        raise ValueError("keep=1 keeps ZeRO-3's gathered parameters: it needs zero=3")
    if lay.checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint={lay.checkpoint!r}: use one of {', '.join(CHECKPOINTS)}")
    if lay.schedule not in SCHEDULES:
        raise ValueError(f"schedule={lay.schedule!r}: use one of 1F1B, interleaved:V, ZB-H1, GPipe")
    if lay.schedule == "interleaved":
        if lay.pp > 1 and lay.micro % lay.pp:
            raise ValueError(f"the interleaved schedule sends micro-batches round the {lay.pp} "
                             f"stages in groups of {lay.pp}: micro={lay.micro} must be a multiple")
        per_stage = -(-model.layers // lay.pp)
        if lay.v > per_stage:
            raise ValueError(f"v={lay.v} stages per GPU is more than the {per_stage} layers each "
                             f"pipeline stage holds")
    elif lay.v != 1:
        raise ValueError(f"v={lay.v} stages per GPU needs schedule=interleaved:{lay.v}")
    if lay.cp_kind not in CP_KINDS:
        raise ValueError(f"cp-kind={lay.cp_kind!r}: use all-gather or ring")
    check_order(lay.order)


LAYOUT_KEYS = {
    "dp": "data-parallel degree (default: the GPUs left by tp x pp x cp)",
    "tp": "tensor-parallel degree", "pp": "pipeline-parallel degree",
    "cp": "context-parallel degree (default 1)",
    "sp": "1: sequence parallelism with tp (default 0)",
    "zero": "ZeRO stage 0-3 over the data-parallel ranks (default 1)",
    "keep": "1: ZeRO-3 gathers the parameters and reduces the gradients once per step (default 0)",
    "micro": "micro-batches per step, each of batch / (dp x micro) sequences (default 1)",
    "checkpoint": "none; selective (recompute attention's core, Megatron-LM's); matmuls (keep "
                  "the products' outputs, notebook 14's policy); full (keep each layer's input)",
    "schedule": "1F1B, interleaved:V (V stages per GPU), ZB-H1 or GPipe (default 1F1B)",
    "vocab": "1: embedding, output layer and loss cut over the tensor ranks (default 1)",
    "order": f"rank order, innermost first (default {ORDERS[0]}; Llama 3: {ORDERS[1]})",
    "cp-kind": "all-gather or ring (default all-gather)",
}


def parse_layout(text: str, gpus: int | None = None) -> Layout:
    """A layout from ``key=value`` pairs separated by commas (``LAYOUT_KEYS``)."""
    raw: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq or key not in LAYOUT_KEYS:
            raise ValueError(f"layout item {item!r}: write key=value with a key among "
                             f"{', '.join(LAYOUT_KEYS)}")
        if key in raw:
            raise ValueError(f"layout key {key!r} is given twice")
        raw[key] = value.strip()
    if "tp" not in raw or "pp" not in raw:
        raise ValueError("a layout names at least tp and pp (and dp, or the GPUs it leaves)")

    def whole(key: str, default: int | None = None) -> int:
        if key not in raw:
            return default
        try:
            return int(raw[key])
        except ValueError:
            raise ValueError(f"layout: {key}={raw[key]!r} is not a whole number") from None

    def flag(key: str, default: bool) -> bool:
        if key not in raw:
            return default
        if raw[key] not in ("0", "1"):
            raise ValueError(f"layout: {key}={raw[key]!r}: give 0 or 1")
        return raw[key] == "1"

    tp, pp, cp = whole("tp"), whole("pp"), whole("cp", 1)
    dp = whole("dp")
    if dp is None:
        if gpus is None or min(tp, pp, cp) <= 0 or gpus % (tp * pp * cp):
            raise ValueError(f"layout: give dp, or tp x pp x cp = {tp} x {pp} x {cp} that divides "
                             f"the cluster's GPUs")
        dp = gpus // (tp * pp * cp)
    schedule, v = raw.get("schedule", "1F1B"), 1
    name, colon, count = schedule.partition(":")
    if name.lower() == "interleaved":
        schedule = "interleaved"
        try:
            v = int(count) if colon else 2
        except ValueError:
            raise ValueError(f"layout: schedule={raw['schedule']!r}: write interleaved:V with V a "
                             f"whole number of stages per GPU") from None
    else:
        match = [s for s in SCHEDULES if s.lower() == schedule.lower()]
        schedule = match[0] if match else schedule
    lay = Layout(dp=dp, tp=tp, pp=pp, zero=whole("zero", 1), micro=whole("micro", 1),
                 checkpoint=raw.get("checkpoint", "none"), cp=cp, sp=flag("sp", False),
                 schedule=schedule, v=v, keep=flag("keep", False),
                 vocab_parallel=flag("vocab", True), order=raw.get("order", ORDERS[0]),
                 cp_kind=raw.get("cp-kind", "all-gather"))
    return lay

