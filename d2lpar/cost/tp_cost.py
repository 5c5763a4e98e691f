"""What tensor parallelism costs: collectives, bytes, activation memory, time, as formulas.

For activations of shape (b, s, d) in fp32 (4 bytes), K = 4bsd, on t ranks, each *region* (an MLP or
an attention block: f ... g) runs per training step

    Megatron:             forward 1 all-reduce of K,                backward 1 all-reduce of K
    sequence parallel:    forward 1 all-gather + 1 reduce-scatter,  backward the same

and each rank sends 2(t-1)K/t bytes each way in both cases (an all-reduce *is* a reduce-scatter and an
all-gather). A transformer layer has two regions. Data parallelism instead all-reduces the layer's
gradient once per step, 2(n-1)/n * 4P bytes: tensor parallelism's traffic grows with the batch and
the sequence, data parallelism's with the parameters.

Activation memory per rank, measured (saved tensors) for the blocks of ``d2lpar.strategies.tensor.blocks``
(fp32, no dropout, a heads, MLP width f):

    MLP        4bs(d + 2f/t)                          fc1's input; GELU's input; fc2's input (split)
    attention  4(bsd + 4bsd/t + b a s^2/t)            QKV's input; q, k, v; softmax; out's input
    layer      4(4bsd + 4bs + (4bsd + 2bsf + b a s^2)/t)                        (Megatron)
    layer, SP  4(2bsd + (2bsd + 4bs + 4bsd + 2bsf + b a s^2)/t)                 (sequence parallel)

(the 4bs are LayerNorm's mean and 1/std). Korthikanti et al. (2022) count for a GPT layer in 16-bit
with dropout, h = d: ``sbh(34 + 5as/h)`` on one device, ``sbh(10 + 24/t + 5as/(ht))`` with tensor
parallelism and ``sbh/t (34 + 5as/h)`` with sequence parallelism too; the last assumes the layer keeps
only its shard of each all-gathered input and gathers it again in the backward pass, which ours does
not (the 2bsd that stay whole above).

Time: a layer's forward is 8bsd^2 + 4bs^2 d + 4bsdf flops (the backward twice that), split over t;
its four all-reduces per step go over whatever links join the t GPUs: NVLink inside a node, the
network between nodes. ``tp_step_time`` sets the two beside each other for a described GPU.
"""

from __future__ import annotations

from d2lpar.comm.collectives import ring_rank_formula
from d2lpar.cost.costmodel import MACHINES, Gpu, Link, Machine, allreduce_time

__all__ = ["REGIONS", "comm_formula", "handed_formula", "dp_grad_sent", "activation_bytes", "korthikanti_bytes",
           "layer_flops", "A100_PEAK_BF16", "A100_UTILISATION", "A100_BF16", "describe", "ACROSS_NODES", "tp_step_time"]

REGIONS = {"mlp": 1, "attn": 1, "layer": 2}


def _regions(block: str) -> int:
    if block not in REGIONS:
        raise ValueError(f"unknown block {block!r}: use one of {', '.join(REGIONS)}")
    return REGIONS[block]


def comm_formula(block: str, b: int, s: int, d: int, t: int, sequence_parallel: bool = False,
                 element_size: int = 4) -> dict:
    """Per pass: the collectives one rank runs and the bytes it sends (ring algorithms).

    Same shape as ``CommLog.summary()``; the sequence-parallel gradient sync is not included.
    """
    k, regions = element_size * b * s * d, _regions(block)
    if t == 1:
        return {p: {"counts": {}, "sent": 0.0} for p in ("forward", "backward")}
    counts = ({"all_gather": regions, "reduce_scatter": regions} if sequence_parallel
              else {"all_reduce": regions})
    sent = regions * ring_rank_formula(k, t)  # the sequence-parallel pair moves what the all-reduce does
    return {p: {"counts": dict(counts), "sent": sent} for p in ("forward", "backward")}


def handed_formula(block: str, b: int, s: int, d: int, t: int, sequence_parallel: bool = False,
                   element_size: int = 4) -> list[tuple[str, str, int]]:
    """What ``CommLog.handed()`` must hold: every collective is handed one whole (b, s, d) activation.

    An all-reduce sums it, an all-gather builds it from s/t-token pieces, a reduce-scatter cuts it.
    """
    k, counts = element_size * b * s * d, comm_formula(block, b, s, d, t, sequence_parallel)
    return sorted((kind, phase, k) for phase, c in counts.items()
                  for kind, n in c["counts"].items() for _ in range(n))


def dp_grad_sent(params: int, n: int, element_size: int = 4) -> float:
    """Bytes one rank sends per step when data parallelism all-reduces ``params`` gradients."""
    return ring_rank_formula(element_size * params, n)


def activation_bytes(block: str, b: int, s: int, d: int, heads: int, hidden: int, t: int = 1,
                     sequence_parallel: bool = False) -> float:
    """Bytes of saved activations per rank for our fp32 blocks (the formulas above)."""
    _regions(block)
    mlp = 4 * b * s * (d + 2 * hidden / t)
    attn = 4 * (b * s * d + 4 * b * s * d / t + b * heads * s * s / t)
    if block == "mlp":
        return mlp
    if block == "attn":
        return attn
    norms = 4 * (2 * b * s * d + 4 * b * s)  # two LayerNorms: inputs, means and 1/stds
    return mlp + attn + (norms / t if sequence_parallel else norms)


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                      sequence_parallel: bool = False) -> float:
    """Activation bytes per rank of one GPT layer, 16-bit with dropout (Korthikanti et al., 2022)."""
    if sequence_parallel:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def layer_flops(b: int, s: int, d: int, hidden: int) -> float:
    """Forward flops of one transformer layer (matmuls only): 8bsd^2 + 4bs^2 d + 4bsdf."""
    return 8 * b * s * d * d + 4 * b * s * s * d + 4 * b * s * d * hidden


# Round figures, stated: an A100 peaks at 312 TFLOP/s in dense BF16 and large matrix products
# sustain about 60% of it; eight of them share an NVSwitch (costmodel's "8 GPUs, NVSwitch").
# Notebooks 12 and 13 (and zero_cost.plan) use this one figure; describe() prints how it is made.
A100_PEAK_BF16, A100_UTILISATION = 312e12, 0.6
A100_BF16 = Gpu("A100, BF16", A100_UTILISATION * A100_PEAK_BF16, 10e-6)


def describe(gpu: Gpu = A100_BF16, peak: float = A100_PEAK_BF16) -> str:
    """One line: the GPU, its peak, the share of it sustained, and the rate the cost model uses."""
    return (f"GPU: {gpu.name}, peak {peak / 1e12:.0f} TFLOP/s, {gpu.rate / peak:.0%} of it sustained "
            f"= {gpu.rate / 1e12:.0f} TFLOP/s")

# Between nodes each GPU has its own 200 Gb/s InfiniBand port: about 20 GB/s in practice.
ACROSS_NODES = Machine("8 nodes, InfiniBand 200 Gb/s per GPU", 8, Link(20e9, 10e-6), 500e9)


def tp_step_time(b: int, s: int, d: int, hidden: int, t: int, machine: Machine | None = None,
                 gpu: Gpu = A100_BF16, element_size: int = 2) -> dict[str, float]:
    """Seconds per training step of one layer on t GPUs: its matmuls, and its four all-reduces."""
    machine = machine or MACHINES["8 GPUs, NVSwitch"]
    compute = gpu.time(3 * layer_flops(b, s, d, hidden) / t)
    comm = 4 * allreduce_time("ring", element_size * b * s * d, t, machine)
    return {"compute": compute, "comm": comm, "comm_share": comm / (compute + comm)}
