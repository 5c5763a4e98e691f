"""Memory's levers as formulas: recomputing activations, lower precision, and a sharded model's
bytes.

**Activations of the course's transformer layer** (notebook 12, fp32, b sequences of s tokens, width
d, a heads, MLP width f): ``tp_cost.activation_bytes`` counts what autograd saves,
4(8bsd + 4bs + 2bsf + b a s^2) bytes per layer on one device. Over L layers:

    no checkpointing          L * A                      A: one layer's saved bytes
    full, every k layers      ceil(L/k) * X              X = 4bsd: only each segment's input is kept
    selective (save matmuls)  L * 4bs(6d + f)            the input, and the outputs of qkv, out,
                                                         fc1, fc2

and the backward pass of a checkpointed segment first recomputes it, holding its k layers' A at
once: the peak is M(k) = ceil(L/k) X + k A, smallest near **k = sqrt(L X / A)** (the sqrt(L) rule,
for X ~ A). Extra forward FLOPs (matmuls, what ``FlopCounterMode`` counts): a full checkpoint
recomputes the whole forward, L * (8bsd^2 + 4bs^2 d + 4bsdf), a third more than a training step's 3
forwards' worth, less the last product of each segment (ceil(L/k) * 2bsdf: torch stops recomputing
once the backward has what it needs); saving the matmuls recomputes only the attention's two batched
products, L * 4bs^2 d.

**Bytes per parameter** with AdamW: fp32 training keeps 4 (weights) + 4 (gradients) + 8 (two
moments) = 16; mixed precision keeps 2 (bf16 weights) + 2 (bf16 gradients) + 4 (fp32 master weights)
+ 8 = 16, and 20 when gradients are also accumulated in fp32 (the Ultra-Scale Playbook's table: 1B
-> 16 / 20 GB, 7B -> 112 / 140, 70B -> 1,120 / 1,400).

**A sharded model** (FSDP2 over N ranks, tensor parallelism of degree t first): of P parameters,
P_split are cut in t (the linear layers' weights, and the biases of the column-parallel ones), the
other P_rest are whole on each tensor-parallel rank; each rank then keeps 1/N of its piece:

    sharded parameters = sharded gradients = 4 (P_split/t + P_rest) / N
    optimizer state    = 2 x that, + 4 bytes per parameter tensor (AdamW's step counts)
    all-gather buffer  = one layer's 4 (p_split/t + p_rest), while that layer runs
    gathered root      = 4 (2 V d + 2d): the embedding, the output layer and the last LayerNorm stay
                         gathered from the forward pass to the backward (FSDP2 keeps the root's)
    activations        = L * tp_cost.activation_bytes("layer", ..., t) + 4(2bsd + 2bs + bsV) + 8
                         (the layers; the last LayerNorm, the output layer's input, the log-softmax
                         of the logits, and the loss with its weight, one float each)
"""

from __future__ import annotations

import math

from d2lpar.cost.tp_cost import activation_bytes, layer_flops

__all__ = ["BYTES", "bytes_per_parameter", "playbook_table", "layer_activations", "input_bytes",
           "saved_bytes", "checkpoint_peak", "best_spacing", "recompute_flops", "step_flops",
           "split_parameters", "sharded_bytes", "dry_run_formula",
           "korthikanti_selective_overhead"]

# bytes per parameter: (weights, gradients, master weights, optimizer state, fp32 gradient buffer)
BYTES = {"fp32": (4, 4, 0, 8, 0), "bf16 mixed": (2, 2, 4, 8, 0),
         "bf16 mixed, fp32 grads": (2, 2, 4, 8, 4)}


def bytes_per_parameter(kind: str = "bf16 mixed") -> int:
    if kind not in BYTES:
        raise ValueError(f"kind={kind!r}: use one of {sorted(BYTES)}")
    return sum(BYTES[kind])


def playbook_table(sizes=(1e9, 7e9, 70e9)) -> list[tuple[float, float, float]]:
    """(parameters, GB with bf16 mixed precision, GB with fp32 gradient accumulation) per size."""
    return [(n, n * bytes_per_parameter("bf16 mixed") / 1e9,
             n * bytes_per_parameter("bf16 mixed, fp32 grads") / 1e9) for n in sizes]


def layer_activations(b: int, s: int, d: int, heads: int, hidden: int, t: int = 1) -> float:
    """A: bytes one course transformer layer saves for its backward (fp32), per tensor-parallel
    rank."""
    return activation_bytes("layer", b, s, d, heads, hidden, t)


def input_bytes(b: int, s: int, d: int) -> int:
    """X: one layer's input, what a checkpointed segment keeps (fp32)."""
    return 4 * b * s * d


MODES = ("none", "full", "selective")


def _mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use 'none', 'full' (every k layers) or 'selective' (save "
                         "matmuls)")


def saved_bytes(mode: str, L: int, b: int, s: int, d: int, heads: int, hidden: int,
                every: int = 1) -> float:
    """Bytes saved by the forward pass of L layers, kept until the backward pass."""
    _mode(mode)
    if mode == "none":
        return L * layer_activations(b, s, d, heads, hidden)
    if mode == "full":
        return math.ceil(L / every) * input_bytes(b, s, d)
    return L * 4 * b * s * (6 * d + hidden)


def checkpoint_peak(L: int, k: int, X: float, A: float) -> float:
    """M(k) = ceil(L/k) X + k A: the segments' inputs, and one segment recomputed for its
    backward."""
    return math.ceil(L / k) * X + k * A


def best_spacing(L: int, X: float, A: float) -> float:
    """The k that minimises L X / k + k A: sqrt(L X / A) (sqrt(L) when X = A)."""
    return math.sqrt(L * X / A)


def recompute_flops(mode: str, L: int, b: int, s: int, d: int, hidden: int,
                    every: int = 1) -> float:
    """Extra forward matmul FLOPs that checkpointing adds to one training step.

    torch stops recomputing a segment once it has every tensor the backward needs: the segment's
    last product (the last layer's fc2, 2bsdf FLOPs, whose output nothing inside saves) is skipped.
    """
    _mode(mode)
    if mode == "none":
        return 0.0
    if mode == "full":
        return L * layer_flops(b, s, d, hidden) - math.ceil(L / every) * 2 * b * s * d * hidden
    return L * 4 * b * s * s * d


def korthikanti_selective_overhead(s: int, h: int, l: int, V: int) -> float:
    """Extra FLOPs of selective recomputation as Korthikanti et al. 2022 count them (Appendix A): a
    step is 72 B s l h^2 (1 + s/6h + V/12lh); recomputing the core attention makes s/6h into s/3h,
    so the extra share is (s/6h) / (1 + s/6h + V/12lh): the attention core's forward and backward
    (12 b s^2 h per layer), where ``recompute_flops`` counts the recomputed forward (4 b s^2 h)."""
    return (s / (6 * h)) / (1 + s / (6 * h) + V / (12 * l * h))


def step_flops(L: int, b: int, s: int, d: int, hidden: int) -> float:
    """Matmul FLOPs of a training step without checkpointing: forward, then backward twice that."""
    return 3 * L * layer_flops(b, s, d, hidden)


def split_parameters(layers: int, d: int, heads: int, hidden: int,
                     vocab: int) -> tuple[int, int, int, int]:
    """(P_split, P_rest) of the whole model and (p_split, p_rest) of one layer, for the course's GPT
    (``d2lpar.strategies.memory.dry_run.GPTConfig``) under Megatron's column/row split."""
    # qkv (w, b), out w, fc1 (w, b), fc2 w
    p_split = 3 * d * d + 3 * d + d * d + d * hidden + hidden + hidden * d
    p_rest = d + d + 4 * d   # out's and fc2's biases, two LayerNorms
    root = 2 * vocab * d + 2 * d   # embedding, output layer, final LayerNorm
    return layers * p_split, layers * p_rest + root, p_split, p_rest


def sharded_bytes(P_split: int, P_rest: int, n: int, t: int = 1, element: int = 4) -> float:
    """Bytes of one rank's shard: element * (P_split / t + P_rest) / n."""
    return element * (P_split / t + P_rest) / n


def dry_run_formula(layers: int, d: int, heads: int, hidden: int, vocab: int, mesh_shape, b: int,
                    s: int) -> dict[str, float]:
    """What ``dry_run`` should measure for rank 0, by category (see the module docstring).

    FSDP2 cuts each tensor along dim 0 (its rows on this tensor-parallel rank) into N pieces
    padded to ceil(rows / N) rows each (torch.distributed.fsdp's ``FSDPParam``): rank 0 keeps
    ceil(rows / N) rows of every tensor, and the gathered blocks (a layer's all-gather buffer, the
    root) N times that, padding included. When N divides every dim 0 this is the module
    docstring's 4 (P_split/t + P_rest) / N."""
    n, t = (mesh_shape[0], mesh_shape[1] if len(mesh_shape) > 1 else 1)
    for name, size in (("heads", heads), ("d", d), ("hidden", hidden)):
        if size % t:
            raise ValueError(f"{name}={size} does not divide over tensor-parallel degree {t}")

    def rank0(shapes) -> int:   # elements rank 0 keeps of these (rows, columns) tensors
        return sum(-(-rows // n) * cols for rows, cols in shapes)

    # a layer on one tensor-parallel rank: 2 LayerNorms (weight, bias); qkv and fc1 cut by rows,
    # out and fc2 by columns (their biases whole)
    layer = [(d, 1)] * 4 + [(3 * d // t, d), (3 * d // t, 1), (d, d // t), (d, 1),
                            (hidden // t, d), (hidden // t, 1), (d, hidden // t), (d, 1)]
    root = [(vocab, d), (vocab, d), (d, 1), (d, 1)]   # embedding, output layer, final LayerNorm
    shard = 4 * (layers * rank0(layer) + rank0(root))
    tensors = layers * len(layer) + len(root)   # AdamW's step counts: one float per tensor
    # final LayerNorm, the output layer's input, log-softmax
    head = 4 * (2 * b * s * d + 2 * b * s + b * s * vocab) + 8
    return {"sharded_param": shard, "sharded_grad": shard, "opt": 2 * shard + 4 * tensors,
            "unsharded_param": 4 * n * rank0(root), "all_gather": 4 * n * rank0(layer),
            "act": layers * layer_activations(b, s, d, heads, hidden, t) + head}
