"""What the planner's price used to leave out, kept as names for older notebook cells.

The planner (``pricing``) now prices each of these terms itself: ZeRO-3's gathers and
reduce-scatter in every micro-batch, activation memory under tensor and sequence parallelism per
Korthikanti et al. 2022 (Table 2, as ``transformer.layer_activation_bytes`` counts it), and full
recomputation as Megatron-LM reruns it (the whole forward and its two tensor-parallel all-reduces).
So ``zero3_per_microbatch`` and ``megatron_recompute`` return the planner's own price, and
``repriced`` prices the plan's layout again with sequence parallelism on or off.
"""

from __future__ import annotations

from dataclasses import replace

from d2lpar.cost.planner import Cluster, Model, Plan, evaluate
from d2lpar.cost.tp_cost import korthikanti_bytes

__all__ = ["korthikanti_layer_bytes", "zero3_per_microbatch", "repriced", "megatron_recompute"]


def korthikanti_layer_bytes(b: int, s: int, h: int, a: int, t: int, checkpoint: str,
                            sp: bool) -> float:
    """Bytes of 16-bit activations one transformer layer saves per micro-batch on a tensor rank,
    Korthikanti et al. 2022, Table 2 (``tp_cost.korthikanti_bytes``); selective recomputation drops
    the attention core's 5as/(ht) term, full recomputation keeps the layer's input only (2sbh, over
    t with sequence parallelism)."""
    if checkpoint == "full":
        return 2 * s * b * h / (t if sp else 1)
    full = korthikanti_bytes(s, b, h, a, t, sp)
    return full if checkpoint == "none" else full - 5 * a * s * s * b / t


def zero3_per_microbatch(p: Plan, model: Model, cluster: Cluster) -> dict[str, float]:
    """``p``'s step by part: the planner pays ZeRO-3's traffic in every micro-batch already."""
    return dict(p.time)


def repriced(p: Plan, model: Model, cluster: Cluster, sp: bool | None = False) -> Plan:
    """``p``'s layout priced again with sequence parallelism ``sp`` (None: ``p`` as it is)."""
    if sp is None:
        return p
    return evaluate(model, cluster, replace(p.layout, sp=bool(sp) and p.layout.tp > 1))


def megatron_recompute(p: Plan, model: Model, cluster: Cluster) -> Plan:
    """``p`` as it is: the planner prices full recomputation as Megatron-LM reruns it."""
    return p
