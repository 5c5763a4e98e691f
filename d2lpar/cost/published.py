"""Published figures, recomputed with the formulas the planner uses, and published training runs
priced by the planner.

* Megatron-LM (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", arXiv 2104.04473), eq. 2: a GPT of l layers, width h, vocabulary V and
  sequence s has P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)) parameters; eq. 3: one step of B
  sequences costs F = 96 B s l h^2 (1 + s/(6 h) + V/(16 l h)) FLOPs, counting the recomputed forward
  (96 = 4 passes x 24: hardware-style FLOPs); eq. 4: training on T tokens with n GPUs at X FLOP/s
  each takes about 8 T P / (n X) seconds (6 T P for forward and backward, 2 T P more to recompute).
  Its Table 2 sets ZeRO-3 without model parallelism against PTD-P (tensor x pipeline x data) for the
  175B model at batch 1,536 (``MEGATRON_TABLE_2``), in teraFLOP/s per GPU by eq. 3.
* Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv
  2205.05198), Table 5: seconds per iteration with selective recomputation and sequence
  parallelism for the layouts of its Table 3 (``KORTHIKANTI_TABLE_5``).
* Llama 3 (arXiv 2407.21783), Table 4: the 405B model's layouts on H100s and their BF16 MFU
  (``LLAMA3_TABLE_4``).
* torchtitan's Llama 3.1 8B on 8 H100s: tokens per second per GPU turned into MFU with its FLOPs per
  token, 6 (N - N_embedding) + 12 l a d_h s, at the H100's 989 TFLOP/s dense bf16 peak.
* The JAX scaling book: data parallelism is compute-bound when each GPU's batch exceeds
  peak FLOP/s / link bandwidth tokens: 990e12 / 450e9 = 2,200 on H100s inside a node.

``published_runs`` prices each published layout with the planner (``planner.evaluate``) and sets
the planner's figure beside the paper's. What the papers do not state is assumed, the same way for
every run: one sequence per micro-batch; Megatron-LM's rank order and the plain 1F1B schedule for
its runs; for Llama 3's, its own rank order (tp-cp-pp-dp), ZeRO-3 that keeps the step's parameters
(section 3.3.2), no activation checkpointing (section 3.3.2) and the interleaved schedule with the
stages per GPU the planner finds fastest (the paper does not give them).
"""

from __future__ import annotations

import dataclasses

from d2lpar.cost import planner as P
from d2lpar.cost.presets import MODELS, hardware_cluster

__all__ = ["megatron_parameters", "MEGATRON_TABLE_1", "MEGATRON_TABLE_2", "megatron_days",
           "megatron_step_flops", "table_2_layouts", "price_table_2", "torchtitan_mfu",
           "compute_bound_batch", "A100_PEAK", "KORTHIKANTI_TABLE_5", "LLAMA3_TABLE_4",
           "korthikanti_run", "llama3_run", "published_runs", "Run"]

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
    micro-batch per step (each GPU's batch/GPUs sequences at once: the table's micro-batch sizes 4,
    2, 1); PTD-P with tp x pp = Table 2's model-parallel size of 96 (tp 8 x pp 12: the table gives
    only the product), one sequence per micro-batch, its embedding and loss cut over the tensor
    ranks."""
    dp = gpus // (tp * pp)
    return {"ZeRO-3": P.Layout(gpus, 1, 1, zero=3, micro=1, checkpoint="full"),
            "PTD-P": P.Layout(dp, tp, pp, zero=0, micro=model.batch // dp, checkpoint="full",
                              vocab_parallel=True)}


def price_table_2(model: P.Model | None = None, kind: str = "a100",
                  **kw) -> dict[int, dict[str, tuple]]:
    """GPUs -> scheme -> (the planner's Plan, its TFLOP/s per GPU by eq. 3) for Table 2's rows, on
    that many GPUs of ``kind`` (``presets.HARDWARE``)."""
    model = model or MODELS["gpt3-175b"]
    if not isinstance(kind, str):          # a Cluster, as callers before the GPU kinds passed
        kind = "a100"
    flops = megatron_step_flops(model.batch, model.seq, model.layers, model.d, model.vocab)
    out = {}
    for gpus in MEGATRON_TABLE_2:
        cl = hardware_cluster(kind, gpus)
        out[gpus] = {}
        for scheme, lay in table_2_layouts(model, gpus, **kw).items():
            p = P.evaluate(model, cl, lay)
            out[gpus][scheme] = (p, flops / (p.step * gpus) / 1e12)
    return out


# Korthikanti et al. 2022, Table 3's layouts and Table 5's seconds per iteration with selective
# recomputation and sequence parallelism: (preset, tensor, pipeline, GPUs, global batch, seconds)
KORTHIKANTI_TABLE_5 = [("megatron-22b", 8, 1, 8, 4, 1.10), ("gpt3-175b", 8, 8, 64, 64, 13.75),
                       ("mt-nlg-530b", 8, 35, 280, 280, 37.83),
                       ("megatron-1t", 8, 64, 512, 512, 71.49)]

# Llama 3, Table 4 (405B on H100s): (GPUs, tp, cp, pp, dp, sequence, TFLOP/s per GPU, BF16 MFU %),
# 16M tokens per batch in every row
LLAMA3_TABLE_4 = [(8192, 8, 1, 16, 64, 8192, 430, 43), (16384, 8, 1, 16, 128, 8192, 400, 41),
                  (16384, 8, 16, 16, 8, 131072, 380, 38)]


def korthikanti_run(key: str, tp: int, pp: int, gpus: int, batch: int):
    """(model, cluster, layout) of a Table 5 run: selective recomputation, sequence parallelism,
    vocabulary-parallel embedding and loss, one sequence per micro-batch, plain 1F1B."""
    model = dataclasses.replace(MODELS[key], batch=batch)
    dp = gpus // (tp * pp)
    lay = P.Layout(dp, tp, pp, zero=0, micro=batch // dp, checkpoint="selective", sp=True,
                   vocab_parallel=True)
    return model, hardware_cluster("a100", gpus), lay


def llama3_run(gpus: int, tp: int, cp: int, pp: int, dp: int, seq: int):
    """(model, cluster, layout) of a Table 4 row (the module docstring's assumptions), with the
    interleaved schedule's stages per GPU the planner finds fastest."""
    model = dataclasses.replace(MODELS["llama3-405b"], seq=seq, batch=16 * 2 ** 20 // seq)
    cluster = hardware_cluster("h100", gpus)
    per_stage = -(-model.layers // pp)
    best = None
    for v in (v for v in range(1, per_stage + 1) if per_stage % v == 0):
        lay = P.Layout(dp, tp, pp, zero=3, keep=True, micro=model.batch // dp, checkpoint="none",
                       cp=cp, sp=True, schedule="interleaved" if v > 1 else "1F1B", v=v,
                       vocab_parallel=True, order="tp-cp-pp-dp")
        p = P.evaluate(model, cluster, lay)
        if best is None or p.step < best[1].step:
            best = (lay, p)
    return model, cluster, best[0]


@dataclasses.dataclass
class Run:
    """A published run beside the planner's price of its layout."""
    source: str          # paper and table
    name: str
    unit: str
    published: float
    planner: float
    plan: P.Plan

    @property
    def ratio(self) -> float:
        """The planner's figure over the paper's (for seconds, above 1: the planner is slower)."""
        return self.planner / self.published


def published_runs() -> list[Run]:
    """Every run of Megatron-LM's Table 2, Korthikanti et al.'s Table 5 and Llama 3's Table 4,
    priced by the planner with its published layout."""
    runs = []
    for gpus, row in price_table_2().items():
        for (scheme, (plan, tflops)), published in zip(row.items(), MEGATRON_TABLE_2[gpus]):
            runs.append(Run("Megatron-LM 2021, Table 2", f"GPT-3 175B {scheme}, {gpus} A100s",
                            "TFLOP/s per GPU (eq. 3)", published, tflops, plan))
    for key, tp, pp, gpus, batch, seconds in KORTHIKANTI_TABLE_5:
        model, cluster, lay = korthikanti_run(key, tp, pp, gpus, batch)
        plan = P.evaluate(model, cluster, lay)
        runs.append(Run("Korthikanti et al. 2022, Table 5", f"{model.name}, {gpus} A100s",
                        "seconds per iteration", seconds, plan.step, plan))
    for gpus, tp, cp, pp, dp, seq, _, mfu in LLAMA3_TABLE_4:
        model, cluster, lay = llama3_run(gpus, tp, cp, pp, dp, seq)
        plan = P.evaluate(model, cluster, lay)
        runs.append(Run("Llama 3 2024, Table 4", f"Llama 3 405B, {gpus} H100s, seq {seq:,}",
                        "MFU %", mfu, 100 * P.figures(plan, model, cluster)["mfu"], plan))
    return runs


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
