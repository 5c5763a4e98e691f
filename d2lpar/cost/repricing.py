"""What the planner's price leaves out, priced with the planner's own functions.

Notebook 17 sets the planner's pick beside published measurements; these re-price a plan with
terms the planner does not count, from formulas the course teaches:

* ``zero3_per_microbatch``: ZeRO-3's gathers and reduce-scatter paid in every micro-batch (FSDP
  re-gathers per micro-batch unless the unsharded stage fits), not once per step;
* ``repriced``: that, plus activation memory per Korthikanti et al. 2022, Table 2, with or
  without sequence parallelism (``korthikanti_layer_bytes`` counts one layer's bytes);
* ``megatron_recompute``: full checkpointing as Megatron-LM reruns it (the whole forward and its
  two tensor-parallel all-reduces again).

The planner's own search and prices (``d2lpar.cost.planner``) are unchanged by them.
"""

from __future__ import annotations

import math

from d2lpar.cost.bubble import megatron_ratio, peak_microbatches
from d2lpar.cost.planner import GB, Cluster, Model, Plan, _bytes, step_time

__all__ = ["korthikanti_layer_bytes", "zero3_per_microbatch", "repriced", "megatron_recompute"]


def korthikanti_layer_bytes(b: int, s: int, h: int, a: int, t: int, checkpoint: str, sp: bool) -> float:
    """Bytes of 16-bit activations one transformer layer saves per micro-batch on a tensor rank,
    Korthikanti et al. 2022, Table 2: without sequence parallelism sbh(10 + 24/t + 5as/(ht)) (the
    layer's input, its LayerNorms and dropouts stay whole on every rank), with it sbh/t(34 + 5as/h);
    selective recomputation drops the attention core's 5as/(ht) term, full recomputation keeps the
    layer's input only (2sbh, over t with sequence parallelism)."""
    if checkpoint == "full":
        return 2 * s * b * h / (t if sp else 1)
    core = 5 * a * s / (h * t) if checkpoint == "none" else 0.0
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + core)


def zero3_per_microbatch(p: Plan, model: Model, cluster: Cluster) -> dict[str, float]:
    """``p``'s step with ZeRO-3's gathers and reduce-scatter paid in every micro-batch (m times the
    traffic ``step_time`` prices once per step), the backward passes hiding what they can."""
    t = dict(p.time)
    if p.layout.zero == 3 and p.layout.dp > 1:
        once = step_time(model, cluster, p.layout, dp_overlap=False)["data"]
        t["data"] = max(0.0, p.layout.micro * once - t["compute"] * 2 / 3)
    return t


def repriced(p: Plan, model: Model, cluster: Cluster, sp: bool | None = False) -> Plan:
    """``p`` with ZeRO-3's traffic per micro-batch and, unless ``sp`` is None, its activation memory
    by Korthikanti et al.'s Table 2 (``sp``: with sequence parallelism) in place of the
    planner's."""
    mem = dict(p.memory)
    lay = p.layout
    if sp is not None:
        b, s, h = model.batch // (lay.dp * lay.micro), model.seq, model.d
        layers = math.ceil(model.layers / lay.pp)
        in_flight = peak_microbatches("1F1B", lay.pp, lay.micro)[0]
        per = korthikanti_layer_bytes(b, s, h, model.heads, lay.tp, lay.checkpoint, sp)
        act = layers * per * in_flight
        if lay.checkpoint == "full":    # one layer recomputed at a time holds all it saves
            act += korthikanti_layer_bytes(b, s, h, model.heads, lay.tp, "none", sp)
        if lay.pp == 1:   # final LayerNorm, the output layer's input, its logits (as the planner)
            act += _bytes(model)["act"] * (2 * b * s * h + 2 * b * s + b * s * model.vocab)
        mem["activations"] = act
    return Plan(lay, mem, zero3_per_microbatch(p, model, cluster),
                sum(mem.values()) <= cluster.memory_gb * GB)


def megatron_recompute(p: Plan, model: Model, cluster: Cluster) -> Plan:
    """``p`` with full checkpointing priced as Megatron-LM reruns it: each layer's whole forward
    again (``recompute_flops`` follows torch, which skips each segment's last product, fc2) with its two
    tensor-parallel all-reduces (6 per layer and micro-batch, not 4), the data-parallel reduction
    hidden behind the longer backward as ``step_time`` hides it. Other plans are returned as they
    are."""
    lay = p.layout
    if lay.checkpoint != "full":
        return p
    t = dict(p.time)
    b = model.batch // (lay.dp * lay.micro)
    layers = math.ceil(model.layers / lay.pp)
    fc2 = 2 * b * model.seq * model.d * model.f          # the product torch's recomputation skips
    rate = cluster.peak_flops * cluster.utilisation
    t["compute"] += lay.micro * layers * fc2 / lay.tp / rate
    t["bubble"] = megatron_ratio(lay.pp, lay.micro) * t["compute"]
    t["tensor"] *= 6 / 4
    if t["data"] > 0:   # the longer backward hides more of the reduction, as in step_time
        exposed = step_time(model, cluster, lay, dp_overlap=False)["data"]
        t["data"] = max(0.0, exposed - t["compute"] * 2 / 3)
    return Plan(lay, dict(p.memory), t, p.fits)
