"""What one layout costs: memory per GPU by category and seconds per step by part, from the
course's formulas.

**Memory** (on the fullest stage: the first, the first middle one or the last): the stage's
parameters on one tensor rank (``transformer.layer_parameters``; the embedding on the first stage
and the output layer on the last, cut over the tensor ranks with ``vocab_parallel``), their
gradients and AdamW's state, sharded by ZeRO over the dp cp ranks that hold them
(``zero.model_state_bytes``, with the precision's bytes: ``transformer.PRECISIONS``); the
activations the schedule keeps (``transformer.layer_activation_bytes`` times ``bubble.stage_peak``'s
micro-batches, plus one layer recomputed at a time in the backward pass, plus on the last stage the
final norm, the output layer's input and the loss's fp32 log-softmax, the logits cut over the tensor
ranks with ``vocab_parallel``); ZeRO-3's gathered parameters (one layer and the embedding and output
layer, as FSDP2 keeps its root; the whole stage, and its unsharded gradients, with ``keep``). A
layout fits when the sum is at most the card's memory less the cluster's headroom
(``cluster.usable_bytes``).

**Time per step** = m tau + the bubble + the pipeline's messages + the data-parallel traffic paid
once per step, where tau, one micro-batch on the slowest stage, is

* compute: ``transformer.layer_flops_forward`` forward, twice it backward (FlashAttention: its
  attention 2.5 times), the recomputed forward (``selective`` and ``matmuls``: attention's batched
  products; ``full``: the whole forward, as Megatron-LM reruns it), at the cluster's sustained rate
  (peak x utilisation; attention's products at ``cluster.attention_rate``); the last stage also runs
  the output layer (whole on every tensor rank unless ``vocab_parallel``);
* tensor: per layer 2 all-reduces of the (b, s/cp, d) activation forward, 2 backward, 2 more with
  full recomputation (sequence parallelism moves the same bytes as an all-gather and a
  reduce-scatter: ``tp_cost.comm_formula``), a ring over the tensor group's link
  (``costmodel.allreduce_time``; ``cluster.group_links``), none hidden; with ``vocab_parallel`` one
  more for the embedding and one for the output layer;
* context: per layer the keys and values of the other cp - 1 chunks, ``context_cost.ring_bytes``
  forward, their gradients as many bytes backward (and again forward with full recomputation):
  all exposed with ``cp_kind="all-gather"`` (Llama 3, section 3.3.2); with a ring each hop hides
  behind one block's attention (``context_cost.ring_time``): (cp - 1) max(0, hop - block) exposed;
* data, per micro-batch: ZeRO-2's reduce-scatter of the micro-batch's gradients, hidden behind its
  backward as far as it can be; ZeRO-3's all-gather of each layer for the forward and, in the
  backward, all-gather and reduce-scatter, hidden behind the forward and the backward.

Hiding is ``buckets.uniform_step`` (notebook 09): with buckets (``bucket_bytes``, Megatron-LM's;
ZeRO-3: one layer) the traffic either keeps up, and only the last bucket shows, or it is the
bottleneck; the latency is paid per bucket (per layer for ZeRO-3). A ring reduce-scatter or
all-gather of K bytes over n ranks costs (n - 1)(alpha + K / (n beta)) (``zero_cost``), an
all-reduce twice that.

The bubble is ``bubble.bubble_ratio`` (idle over busy time for the schedule) times m tau. Once per
step: DDP's all-reduce and ZeRO-1's reduce-scatter of the accumulated gradients, of which only the
last micro-batch's backward can hide any; ZeRO-1/2's all-gather of the updated parameters after the
optimizer step, which nothing hides; ZeRO-3 with ``keep``: one all-gather of each layer hidden
behind the first micro-batch's forward and one reduce-scatter of the accumulated gradients hidden
behind the last one's backward (FSDP2 with gradient synchronisation on the last micro-batch only,
as torchtitan pipelines it). The pipeline's messages: 2 (v m + p - 1) sends of the (b, s/cp, d/t)
activation on the critical path (Megatron-LM 2021's scatter/gather: each tensor rank sends its
1/t), none hidden.

``model_flops_per_step``: MFU's numerator as PaLM (Chowdhery et al. 2022, appendix B), Korthikanti
et al. 2022 (eq. 4) and torchtitan count it: per token 6 N for the weights' products (N without
the input embedding, a lookup; the output layer counted) plus attention's 12 L d s (in full,
whatever the mask); no recomputation. ``hardware_flops_per_step`` counts what the GPUs run: the
recomputation, FlashAttention's backward, the output layer on every tensor rank that computes it;
causal FlashAttention skips the masked half, so a model's hardware FLOPs can be below its model
FLOPs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from d2lpar.cost.bubble import bubble_ratio, stage_peak
from d2lpar.cost.buckets import uniform_step
from d2lpar.cost.cluster import Cluster, group_links, usable_bytes
from d2lpar.cost.context_cost import ring_bytes
from d2lpar.cost.costmodel import Link, Machine, allreduce_time
from d2lpar.cost.layout import Layout, check_layout
from d2lpar.cost.transformer import (PRECISIONS, Model, check_model, layer_activation_bytes,
                                     layer_flops_forward, layer_parameters)

__all__ = ["GB", "Plan", "memory", "step_time", "evaluate", "model_flops_per_step",
           "hardware_flops_per_step", "stage_layers", "stage_parameters", "bucket_bytes", "rates"]

GB = 1e9


def bucket_bytes(n: int, element: int) -> float:
    """Megatron-LM's gradient buckets: max(40M, 1M x the data-parallel ranks) elements, so that
    the latency is paid fewer times as the ranks grow (``megatron/core/distributed/
    distributed_data_parallel.py``)."""
    return max(40e6, 1e6 * n) * element


def _schedule(lay: Layout) -> str:
    return "interleaved 1F1B" if lay.schedule == "interleaved" else lay.schedule


def stage_layers(model: Model, lay: Layout) -> list[int]:
    """Layers of each pipeline stage: L // p each, and the L mod p left over on the middle stages
    first, so that the end stages, which also hold the embedding, the output layer and (the first)
    the most micro-batches in flight, get fewer (Llama 3, section 3.3.2, takes one layer from each
    end)."""
    return list(_split(model.layers, lay.pp))


@functools.lru_cache(maxsize=1024)
def _split(L: int, p: int) -> tuple[int, ...]:
    q, r = divmod(L, p)
    layers = [q] * p
    for s in (list(range(1, p - 1)) + [0, p - 1])[:r]:
        layers[s] += 1
    return tuple(layers)


def _ends(model: Model, lay: Layout) -> tuple[float, float]:
    """Parameters of the embedding (first stage) and of the output layer and final norm (last
    stage) on one tensor rank; one stage holds both when pp = 1 (once when tied)."""
    t = lay.tp if lay.vocab_parallel else 1
    table = model.vocab * model.d / t
    norm = 2 * model.d if model.bias else model.d
    if lay.pp == 1:
        return (1 if model.tied else 2) * table + norm, 0.0
    return table, table + norm


def stage_parameters(model: Model, lay: Layout, stage: int = 0) -> float:
    """Parameters one GPU of pipeline stage ``stage`` holds before ZeRO."""
    p_split, p_rest = layer_parameters(model)
    emb, out = _ends(model, lay)
    ends = (emb if stage == 0 else 0.0) + (out if stage == lay.pp - 1 and lay.pp > 1 else 0.0)
    return _split(model.layers, lay.pp)[stage] * (p_split / lay.tp + p_rest) + ends


def _stages(lay: Layout) -> list[int]:
    """The stages that can be the fullest or the slowest: the two ends and the first middle one
    (the middle stage with the most layers and micro-batches in flight)."""
    return sorted({0, min(1, lay.pp - 1), lay.pp - 1})


def model_state_bytes(stage: int, numel: float, n: int, param_bytes: float, grad_bytes: float,
                      optimizer_bytes: float) -> dict[str, float]:
    """``strategies.sharded.zero.model_state_bytes`` (the ZeRO paper's Figure 1: stage 1 shards the
    optimizer state over n ranks, 2 the gradients too, 3 the parameters too), restated here so
    that the command line starts without torch; a test keeps the two equal."""
    return {"params": param_bytes * numel / (n if stage >= 3 else 1),
            "grads": grad_bytes * numel / (n if stage >= 2 else 1),
            "optimizer": optimizer_bytes * numel / (n if stage >= 1 else 1)}


def _micro(model: Model, lay: Layout) -> int:
    return model.batch // (lay.dp * lay.micro)


def _head_bytes(model: Model, lay: Layout, b: int) -> float:
    """The last stage's output: the final norm's input and output (the output layer's input), its
    fp32 statistics, the loss's fp32 log-softmax of the logits and the loss itself."""
    e = PRECISIONS[model.precision]["act"]
    T = b * model.seq / lay.cp
    cut = lay.tp if lay.sp else 1
    vocab = model.vocab / (lay.tp if lay.vocab_parallel else 1)
    return e * 2 * T * model.d / cut + 4 * 2 * T + 4 * T * vocab + 8


def memory(model: Model, lay: Layout) -> dict[str, float]:
    """Bytes per GPU by category, on the fullest stage."""
    by = PRECISIONS[model.precision]
    b = _micro(model, lay)
    act = {c: layer_activation_bytes(model, b, model.seq, lay.tp, lay.cp, lay.sp, c)
           for c in ("none", lay.checkpoint)}
    recompute = act["none"] - act[lay.checkpoint]     # one layer's, during its backward
    sched, n = _schedule(lay), lay.dp * lay.cp
    p_split, p_rest = layer_parameters(model)
    best = None
    layers = stage_layers(model, lay)
    for stage in _stages(lay):
        psi = stage_parameters(model, lay, stage)
        held = stage_peak(sched, lay.pp, lay.micro, lay.v, stage)
        activations = layers[stage] * act[lay.checkpoint] * held + recompute
        if stage == lay.pp - 1:
            activations += _head_bytes(model, lay, b)
        states = model_state_bytes(lay.zero, psi, n, param_bytes=by["param"],
                                   grad_bytes=by["grad"], optimizer_bytes=by["optimizer"])
        if lay.keep:    # the micro-batches' gradients accumulate unsharded until the last one
            states["grads"] = by["grad"] * psi
        out = {"parameters": states["params"], "gradients": states["grads"],
               "optimizer": states["optimizer"], "activations": activations}
        if lay.zero == 3 and n > 1:
            emb, head = _ends(model, lay)
            gathered = psi if lay.keep else p_split / lay.tp + p_rest + emb + head
            out["gathered"] = by["param"] * gathered
        if best is None or sum(out.values()) > sum(best.values()):
            best = out
    return best


def rates(cluster: Cluster) -> float:
    """FLOP/s one GPU sustains."""
    return cluster.peak_flops * cluster.utilisation


def _stage_flops(model: Model, lay: Layout, layers: int, head: bool) -> dict[str, float]:
    """FLOPs of one micro-batch on one GPU of a stage: forward, backward and recomputed forward,
    each split into matrix products ('mm') and attention's batched products ('att')."""
    b = _micro(model, lay)
    T = b * model.seq / lay.cp
    mm, att = layer_flops_forward(model, T, model.seq)
    flash = model.attention == "flash"
    att = att / 2 if flash else att                 # FlashAttention skips the causal mask's half
    k = layers / lay.tp
    rec = {"none": (0.0, 0.0), "selective": (0.0, att), "matmuls": (0.0, att),
           "full": (mm, att)}[lay.checkpoint]
    out = {"fwd_mm": k * mm, "fwd_att": k * att, "bwd_mm": 2 * k * mm,
           "bwd_att": (2.5 if flash else 2) * k * att, "rec_mm": k * rec[0], "rec_att": k * rec[1]}
    if head:
        vocab = 2 * T * model.d * model.vocab / (lay.tp if lay.vocab_parallel else 1)
        out["fwd_mm"] += vocab
        out["bwd_mm"] += 2 * vocab
    return out


def _seconds(flops: dict[str, float], cluster: Cluster, part: str) -> float:
    return (flops[part + "_mm"] / rates(cluster)
            + flops[part + "_att"] / cluster.attention_rate)


def _ring(link: Link, n: int, a_scale: float = 1.0) -> tuple[float, float]:
    """(a, b) of T(K) = a + K b for a ring all-reduce of K bytes over n ranks: 2(n-1) alpha and
    2(n-1)/(n beta) (``buckets``' docstring); half of each for a reduce-scatter or an
    all-gather."""
    return 2 * (n - 1) * link.latency * a_scale, 2 * (n - 1) / (n * link.bandwidth) * a_scale


def _hidden(cap: float, compute: float, nbytes: float, a: float, b: float, overlap: bool) -> float:
    """Seconds of ``nbytes`` of traffic in buckets of ``cap`` that ``compute`` seconds leave
    exposed (``buckets.uniform_step``); all of it without overlap."""
    if nbytes <= 0:
        return 0.0
    return uniform_step(cap, compute if overlap else 0.0, nbytes, a, b) - (compute if overlap
                                                                          else 0.0)


def step_time(model: Model, cluster: Cluster, lay: Layout,
              dp_overlap: bool = True) -> dict[str, float]:
    """Seconds per step: compute, bubble, exposed tensor / context / data / pipeline communication
    (the module docstring). dp_overlap=False: the data-parallel traffic after the backward pass,
    none of it hidden (the course's hand-built 3D run)."""
    e = PRECISIONS[model.precision]["act"]
    b = _micro(model, lay)
    T = b * model.seq / lay.cp
    links = group_links(cluster, {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "pp": lay.pp},
                        lay.order)
    per_stage = stage_layers(model, lay)
    worst = None
    for stage in _stages(lay):
        layers, head, embedding = per_stage[stage], stage == lay.pp - 1, stage == 0
        flops = _stage_flops(model, lay, layers, head)
        fwd_s, bwd_s = (_seconds(flops, cluster, k) for k in ("fwd", "bwd"))
        rec_s = _seconds(flops, cluster, "rec")
        compute = fwd_s + bwd_s + rec_s
        tensor = 0.0
        if lay.tp > 1:
            count = layers * (6 if lay.checkpoint == "full" else 4)
            if lay.vocab_parallel:
                count += int(head) + int(embedding)
            machine = Machine(cluster.name, lay.tp, links["tp"], reduce_bandwidth=1e12)
            tensor = count * allreduce_time("ring", e * T * model.d, lay.tp, machine)
        context = 0.0
        if lay.cp > 1:
            link = links["cp"]
            hop = ring_bytes(b, model.seq, model.d_kv / lay.tp, lay.cp, e) / (lay.cp - 1)
            passes = 3 if lay.checkpoint == "full" else 2      # forward (again), backward
            if lay.cp_kind == "ring":
                att = flops["fwd_att"] / layers / cluster.attention_rate  # one layer's attention
                block_f, block_b = att / lay.cp, 2 * att / lay.cp
                per_layer = (lay.cp - 1) * ((passes - 1) * max(0.0, link.time(hop) - block_f)
                                            + max(0.0, link.time(2 * hop) - block_b))
            else:
                per_layer = passes * (lay.cp - 1) * link.time(hop)
            context = layers * per_layer
        cost = (compute + tensor + context, compute, tensor, context, fwd_s, bwd_s + rec_s)
        if worst is None or cost[0] > worst[0]:
            worst = cost
    _, compute, tensor, context, fwd_s, bwd_s = worst
    per_mb, once = _data_parallel(model, cluster, lay, links, fwd_s, bwd_s, dp_overlap)
    tau = compute + tensor + context + per_mb
    m = lay.micro
    bubble = (bubble_ratio(_schedule(lay), lay.pp, m, lay.v) * m * tau) if lay.pp > 1 else 0.0
    pipeline = 0.0
    if lay.pp > 1:
        msg = e * T * model.d / lay.tp
        pipeline = 2 * (lay.v * m + lay.pp - 1) * links["pp"].time(msg)
    return {"compute": m * compute, "bubble": bubble, "tensor": m * tensor, "context": m * context,
            "data": m * per_mb + once, "pipeline": pipeline}


def _data_parallel(model, cluster, lay, links, fwd_s, bwd_s, overlap) -> tuple[float, float]:
    """(exposed seconds per micro-batch, exposed seconds once per step) of the data-parallel
    traffic over the dp cp ranks that hold the same parameters."""
    n = lay.dp * lay.cp
    if n == 1:
        return 0.0, 0.0
    by = PRECISIONS[model.precision]
    across = any(links[k] == cluster.inter and k_deg > 1
                 for k, k_deg in (("dp", lay.dp), ("cp", lay.cp)))
    link = cluster.inter if across else cluster.intra
    psi = max(stage_parameters(model, lay, s) for s in _stages(lay))
    p_split, p_rest = layer_parameters(model)
    unit = p_split / lay.tp + p_rest                    # ZeRO-3 gathers one layer at a time
    a, b = _ring(link, n)
    pb, gb = by["param"] * psi, by["grad"] * psi
    per_mb = once = 0.0
    gcap, pcap = bucket_bytes(n, by["grad"]), bucket_bytes(n, by["param"])
    after_step = _hidden(pcap, 0.0, pb, a / 2, b / 2, False)    # ZeRO-1/2: nothing hides it
    if lay.zero == 0:
        once = _hidden(gcap, bwd_s, gb, a, b, overlap)
    elif lay.zero == 1:
        once = _hidden(gcap, bwd_s, gb, a / 2, b / 2, overlap) + after_step
    elif lay.zero == 2:
        per_mb = _hidden(gcap, bwd_s, gb, a / 2, b / 2, overlap)
        once = after_step
    elif lay.keep:
        once = (_hidden(by["param"] * unit, fwd_s, pb, a / 2, b / 2, overlap)
                + _hidden(gcap, bwd_s, gb, a / 2, b / 2, overlap))
    else:
        per_mb = (_hidden(by["param"] * unit, fwd_s, pb, a / 2, b / 2, overlap)
                  + _hidden((by["param"] + by["grad"]) * unit, bwd_s, pb + gb, a, b / 2,
                            overlap))
    return per_mb, once


def model_flops_per_step(model: Model, causal: bool = False) -> float:
    """Model FLOPs of one step (PaLM, Chowdhery et al. 2022, appendix B): per token 6 N for the
    weights' products (2 forward, 4 backward) plus attention's 12 L d s; N without the input
    embedding table (a lookup multiplies nothing; the output layer counts, as in torchtitan's MFU
    and Korthikanti et al.'s eq. 4); a recomputed forward is not counted (it is work the model did
    not need). ``causal``: attention counted half, 6 L d s, the products a causal mask needs (the
    convention some reports use; PaLM's, the default, counts them all)."""
    tokens = model.batch * model.seq
    N = model.parameters() - (0 if model.tied else model.vocab * model.d)
    attention = (6 if causal else 12) * model.layers * model.seq * model.d
    return (6 * N + attention) * tokens


def hardware_flops_per_step(model: Model, lay: Layout) -> float:
    """FLOPs the GPUs run in one step: every stage's forward, backward and recomputation on every
    GPU (``model_flops_per_step`` counts the model's only)."""
    total = 0.0
    for stage, layers in enumerate(stage_layers(model, lay)):
        total += sum(_stage_flops(model, lay, layers, stage == lay.pp - 1).values())
    return total * lay.tp * lay.cp * lay.dp * lay.micro


@dataclass
class Plan:
    layout: Layout
    memory: dict[str, float]
    time: dict[str, float]
    fits: bool

    @property
    def step(self) -> float:
        return sum(self.time.values())

    @property
    def peak_memory(self) -> float:
        return sum(self.memory.values())


def evaluate(model: Model, cluster: Cluster, lay: Layout) -> Plan:
    check_model(model)
    check_layout(model, cluster, lay)
    mem = memory(model, lay)
    fits = sum(mem.values()) <= usable_bytes(cluster)
    return Plan(lay, mem, step_time(model, cluster, lay), fits)

