"""Models people train and the clusters they trained them on, as the planner describes them.

Sizes from the papers: GPT-3 175B and Megatron-LM's models (Narayanan et al. 2021, Table 1;
Korthikanti et al. 2022, Table 3: 22B, 175B, 530B, 1T; vocabulary 51,200, sequences of 2,048, the
embedding tied to the output layer, biases, dropout, eager attention, fp32 main gradients); Llama 3
(Llama 3 paper, Table 3: grouped-query attention with 8 key/value heads, SwiGLU, no biases, an
untied output layer, vocabulary 128,256; FlashAttention; fp32 gradient accumulation, section
3.3.2). The global batch of each is the one its paper's throughput table uses (GPT-3: Table 2's
1,536; Korthikanti et al.'s Table 3; Llama 3 405B: Table 4's 16M tokens; Llama 3 8B and 70B, whose
runs Table 4 does not give: 4M tokens, the batch Llama 3 starts from, section 3.4.1); the command
line's ``--batch`` changes it.

Clusters: nodes of 8 GPUs. A100 (Megatron-LM's Selene): 312 TFLOP/s dense bf16 peak, NVLink 3
through NVSwitch at about 230 GB/s of all-reduce bus bandwidth (``costmodel.MACHINES``), one
200 Gb/s InfiniBand card per GPU (25 GB/s of line rate; priced at 20 GB/s, the share an
all-reduce gets from it, as ``tp_cost.ACROSS_NODES``). H100 (Llama 3's Grand Teton): 989 TFLOP/s, NVLink 4 at
about 450 GB/s, one 400 Gb/s card per GPU (50 GB/s of line rate, priced at 40 GB/s likewise; Llama 3,
section 3.3.1). Both: 80 GiB per GPU,
latency 5 us inside a node and 10 us across, 60 % of the peak sustained by large matrix products
(``tp_cost.A100_UTILISATION``, the course's round figure), attention at 50 % of an A100's peak and
35 % of an H100's (FlashAttention-2's figures: ``cluster``'s docstring), 10 % of memory kept back.
"""

from __future__ import annotations

from dataclasses import replace

from d2lpar.cost.cluster import Cluster
from d2lpar.cost.transformer import Model

__all__ = ["MODELS", "CLUSTERS", "HARDWARE", "hardware_cluster", "korthikanti_model",
           "llama3_model"]

HARDWARE = {
    "a100": Cluster("A100-80GB", 8, 8, 80, 312e12, 0.6, 230e9, 5e-6, 20e9, 10e-6,
                    attention_utilisation=0.5),
    "h100": Cluster("H100-80GB", 8, 8, 80, 989e12, 0.6, 450e9, 5e-6, 40e9, 10e-6,
                    attention_utilisation=0.35),
}


def hardware_cluster(kind: str, gpus: int) -> Cluster:
    """``gpus`` GPUs of a described kind (``HARDWARE``), named '<gpus> <kind>'."""
    base = HARDWARE[kind]
    return replace(base, gpus=gpus, name=f"{gpus} {base.name}")


CLUSTERS = {
    "1024 A100-80GB": hardware_cluster("a100", 1024),
    "8 H100": replace(hardware_cluster("h100", 8), name="8 H100"),
    "64 H100": replace(hardware_cluster("h100", 64), name="64 H100"),
    "16384 H100": replace(hardware_cluster("h100", 16384), name="16384 H100"),
}

_MEGATRON = dict(seq=2048, vocab=51200, precision="bf16-fp32-grads", tied=True, dropout=True)


def korthikanti_model(name: str, layers: int, d: int, heads: int, batch: int) -> Model:
    """A GPT as Megatron-LM trains it (the module docstring)."""
    return Model(name, layers, d, heads, batch=batch, **_MEGATRON)


_LLAMA = dict(vocab=128256, precision="bf16-fp32-grads", kv_heads=8, glu=True, bias=False,
              attention="flash")


def llama3_model(name: str, layers: int, d: int, heads: int, ffn: int, batch: int,
                 seq: int = 8192) -> Model:
    """A Llama 3 model (the module docstring)."""
    return Model(name, layers, d, heads, seq, batch=batch, hidden=ffn, **_LLAMA)


MODELS = {
    "gpt3-175b": korthikanti_model("GPT-3 175B", 96, 12288, 96, 1536),
    "megatron-22b": korthikanti_model("Megatron 22B", 48, 6144, 64, 4),
    "mt-nlg-530b": korthikanti_model("MT-NLG 530B", 105, 20480, 128, 280),
    "megatron-1t": korthikanti_model("Megatron 1T", 128, 25600, 160, 512),
    "llama3-8b": llama3_model("Llama 3 8B", 32, 4096, 32, 14336, 512),
    "llama3-70b": llama3_model("Llama 3 70B", 80, 8192, 64, 28672, 512),
    "llama3-405b": llama3_model("Llama 3 405B", 126, 16384, 128, 53248, 2048),
    # the course's layer (GELU MLP, multi-head attention, biases) at Llama 3 8B's sizes and
    # parameter count (``strategies.memory.dry_run.LLAMA_8B_LIKE``)
    "llama-8b-like": Model("8B (Llama 3 8B's sizes)", 32, 4096, 32, 8192, 128256, 64,
                           hidden=18432),
}
