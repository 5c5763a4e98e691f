"""Published figures, recomputed with the formulas the planner uses.

* Megatron-LM (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", arXiv 2104.04473), eq. 2: a GPT of l layers, width h, vocabulary V and
  sequence s has P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)) parameters; eq. 3: one step of B
  sequences costs F = 96 B s l h^2 (1 + s/(6 h) + V/(16 l h)) FLOPs, counting the recomputed forward
  (96 = 4 passes x 24: hardware-style FLOPs); eq. 4: training on T tokens with n GPUs at X FLOP/s
  each takes about 8 T P / (n X) seconds (6 T P for forward and backward, 2 T P more to recompute).
  Its Table 2 sets ZeRO-3 without model parallelism against PTD-P (tensor x pipeline x data) for the
  175B model at batch 1,536 (``MEGATRON_TABLE_2``).
* torchtitan's Llama 3.1 8B on 8 H100s: tokens per second per GPU turned into MFU with its FLOPs per
  token, 6 (N - N_embedding) + 12 l a d_h s, at the H100's 989 TFLOP/s dense bf16 peak.
* The JAX scaling book: data parallelism is compute-bound when each GPU's batch exceeds
  peak FLOP/s / link bandwidth tokens: 990e12 / 450e9 = 2,200 on H100s inside a node.
"""

from __future__ import annotations

import dataclasses

from d2lpar.cost import planner as P
from d2lpar.cost import repricing as RP

__all__ = ["megatron_parameters", "MEGATRON_TABLE_1", "MEGATRON_TABLE_2", "megatron_days",
           "megatron_step_flops", "table_2_layouts", "price_table_2", "torchtitan_mfu", "compute_bound_batch", "A100_PEAK"]

A100_PEAK = 312e12   # dense bf16/fp16 FLOP/s of one A100, the peak Megatron-LM's percentages use

# Megatron-LM's Table 1: (billions of parameters as published, layers, hidden size); V = 51,200, s = 2,048
MEGATRON_TABLE_1 = [(1.7, 24, 2304), (3.6, 30, 3072), (7.5, 36, 4096), (18.4, 40, 6144),
                    (39.1, 48, 8192), (76.1, 60, 10240), (145.6, 80, 12288), (310.1, 96, 16384),
                    (529.6, 105, 20480), (1008.0, 128, 25600)]


# Megatron-LM's Table 2, the 175B model (96 layers, h = 12,288) at a batch of 1,536 sequences:
# GPUs -> (ZeRO-3 without model parallelism, PTD-P with model-parallel size 96) in teraFLOP/s per GPU,
# as the paper reports them
MEGATRON_TABLE_2 = {384: (144, 153), 768: (88, 149), 1536: (44, 141)}


def megatron_step_flops(B: int, s: int, l: int, h: int, V: int = 51200) -> float:
    """Eq. 3: FLOPs of one step of B sequences, the recomputed forward included."""
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def table_2_layouts(model: P.Model, gpus: int, tp: int = 8, pp: int = 12) -> dict[str, P.Layout]:
    """The two schemes of Table 2 on ``gpus`` GPUs as the planner's layouts, both fully checkpointed
    (the recomputation eq. 3 counts): ZeRO-3 over every GPU without model parallelism, one
    micro-batch per step (so its traffic is paid once per step, as the planner prices it); PTD-P
    with tp x pp = Table 2's model-parallel size of 96 (tp 8 x pp 12: the table gives only the
    product) and one sequence per micro-batch."""
    dp = gpus // (tp * pp)
    return {"ZeRO-3": P.Layout(gpus, 1, 1, zero=3, micro=1, checkpoint="full"),
            "PTD-P": P.Layout(dp, tp, pp, zero=0, micro=model.batch // dp, checkpoint="full")}


def price_table_2(model: P.Model, cluster: P.Cluster, **kw) -> dict[int, dict[str, tuple]]:
    """GPUs -> scheme -> (the planner's Plan, its TFLOP/s per GPU by eq. 3) for Table 2's rows, the
    cluster resized to each row's GPUs; full recomputation priced as Megatron-LM runs it."""
    flops = megatron_step_flops(model.batch, model.seq, model.layers, model.d, model.vocab)
    out = {}
    for gpus in MEGATRON_TABLE_2:
        cl = dataclasses.replace(cluster, gpus=gpus, name=f"{gpus} GPUs")
        out[gpus] = {}
        for scheme, lay in table_2_layouts(model, gpus, **kw).items():
            p = RP.megatron_recompute(P.evaluate(model, cl, lay), model, cl)
            out[gpus][scheme] = (p, flops / (p.step * gpus) / 1e12)
    return out


def megatron_parameters(l: int, h: int, V: int = 51200, s: int = 2048) -> float:
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def megatron_days(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    return 8 * tokens * params / (gpus * flops_per_gpu) / 86400


def torchtitan_mfu(tokens_per_s_per_gpu: float, params: float, embedding: float, layers: int,
                   heads: int, head_dim: int, seq: int, peak: float = 989e12) -> float:
    flops_per_token = 6 * (params - embedding) + 12 * layers * heads * head_dim * seq
    return tokens_per_s_per_gpu * flops_per_token / peak


def compute_bound_batch(peak_flops: float = 990e12, bandwidth: float = 450e9) -> float:
    """Tokens per GPU above which a data-parallel step's compute outlasts its gradient traffic."""
    return peak_flops / bandwidth
