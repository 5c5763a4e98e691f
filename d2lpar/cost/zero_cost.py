"""When to use which: memory and time of DP and ZeRO-1/2/3 for a model on a described cluster.

Memory per GPU is ``d2lpar.strategies.sharded.zero.model_state_bytes`` (mixed precision, as in the ZeRO
paper: p = 2 bytes of fp16 parameters, g = 2 of fp16 gradients, k = 12 of fp32 master weights,
momentum and variance); activations come on top and are left out here, as in the paper's Figure 1.

Time per step = compute + communication (no overlap: the upper bound). Compute is about 6 Psi FLOPs
per token (2 forward, 4 backward); communication is in half-rings: a reduce-scatter or an all-gather
of K bytes over N GPUs is N-1 rounds of K/N bytes on every link at once,

    t_half = (N-1) (alpha + K / (N beta)),

and DP, ZeRO-1 and ZeRO-2 need two halves per step (K = p Psi of gradients, then parameters), ZeRO-3
three (parameters gathered for forward and again for backward). The links are those of
``d2lpar.cost.costmodel``'s described machines.
"""

from __future__ import annotations

from d2lpar.cost.costmodel import MACHINES, Machine
from d2lpar.cost.tp_cost import A100_BF16
from d2lpar.strategies.sharded.zero import model_state_bytes, sent_bytes

__all__ = ["NAMES", "paper_table", "half_ring_time", "plan", "plan_table"]

NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
MIXED = dict(param_bytes=2, grad_bytes=2, optimizer_bytes=12)


def paper_table(psi: float = 7.5e9, n: int = 64) -> list[tuple[str, float]]:
    """The ZeRO paper's Figure 1 example: GB of model states per GPU for ``psi`` parameters on n GPUs."""
    return [(NAMES[s], sum(model_state_bytes(s, psi, n, **MIXED).values()) / 1e9) for s in NAMES]


def half_ring_time(nbytes: float, n: int, machine: Machine) -> float:
    """Seconds for a reduce-scatter (or an all-gather) of ``nbytes`` over n devices of ``machine``."""
    return 0.0 if n == 1 else (n - 1) * machine.device_link.time(nbytes / n)


def plan(psi: float, tokens_per_gpu: float, machine: Machine | None = None,
         flops: float = A100_BF16.rate, gpu_memory: float = 80e9) -> list[dict]:
    """One row per strategy: GB of model states, seconds of compute and of communication, fits?

    flops: sustained FLOP/s per GPU (default: ``tp_cost.A100_BF16``, an A100's 312 TFLOP/s bf16
    peak at 60%, the figure notebook 12 uses too).
    """
    machine = machine or MACHINES["8 GPUs, NVSwitch"]
    n = machine.devices
    compute = 6 * psi * tokens_per_gpu / flops
    rows = []
    for s, name in NAMES.items():
        mem = sum(model_state_bytes(s, psi, n, **MIXED).values())
        halves = sent_bytes(s, 1, n) / sent_bytes(0, 1, n) * 2  # 2, or 3 for ZeRO-3
        comm = halves * half_ring_time(MIXED["param_bytes"] * psi, n, machine)
        rows.append({"strategy": name, "memory_gb": mem / 1e9, "compute_s": compute,
                     "comm_s": comm, "step_s": compute + comm, "fits": mem < gpu_memory})
    return rows


def plan_table(psi: float, tokens_per_gpu: float, machine: Machine | None = None, **kw) -> str:
    machine = machine or MACHINES["8 GPUs, NVSwitch"]
    lines = [f"{psi / 1e9:g}B parameters, {tokens_per_gpu:g} tokens per GPU per step, {machine.name}",
             f"  {'':8}{'GB/GPU':>8}{'compute s':>11}{'comm s':>9}{'step s':>9}  fits in 80 GB"]
    for r in plan(psi, tokens_per_gpu, machine, **kw):
        lines.append(f"  {r['strategy']:8}{r['memory_gb']:8.1f}{r['compute_s']:11.3f}"
                     f"{r['comm_s']:9.3f}{r['step_s']:9.3f}  {'yes' if r['fits'] else 'no'}")
    return "\n".join(lines)
