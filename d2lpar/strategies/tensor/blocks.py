"""Tensor-parallel transformer blocks: an MLP, self-attention with heads split over ranks, a layer.

**MLP** ``fc2(GELU(fc1(x)))``: fc1 is column-parallel (rank r computes hidden/t features), fc2 is
row-parallel (rank r consumes exactly those), so GELU runs on the split features with no
communication; f before fc1, g after fc2. **Attention**: the heads are independent, so a
column-parallel QKV projection that gives rank r the q, k, v of heads r*a/t .. (r+1)*a/t - 1 lets each
rank attend with its own heads; the output projection is row-parallel. The QKV weight is laid out
head by head (q, k, v of head 0, then of head 1, ...), Megatron's layout, so a contiguous block of
rows is a set of whole heads. Per transformer layer, Megatron therefore needs

    forward: 2 all-reduces (attention, MLP),   backward: 2 all-reduces (the two f's)

of a b x s x d activation each. With **sequence parallelism** each all-reduce becomes a reduce-scatter
(leaving a region) and an all-gather (entering the next), the LayerNorms and residuals run on s/t
tokens, and the parameters used there (LayerNorm weights, the row-parallel biases) get a partial
gradient on each rank: ``sync_sequence_parallel_grads`` sums them (one all-reduce of a few d floats).

The single-device modules (``MLP``, ``SelfAttention``, ``TransformerLayer``) are the baselines; they
also run under PyTorch's ``parallelize_module`` (attention counts its heads from the width it is given).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from d2lpar.strategies.tensor.mappings import (check_same_shape, record_comm, require_divisible,
                                               tp_world)
from d2lpar.strategies.tensor.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["MLP", "SelfAttention", "TransformerLayer", "attention", "ParallelMLP",
           "ParallelSelfAttention", "ParallelLayerNorm", "ParallelTransformerLayer",
           "sync_sequence_parallel_grads", "gather_full"]


# ----------------------------------------------------------------------- single-device baselines

def attention(qkv: torch.Tensor, head_dim: int, causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(dh)) v for every head; qkv is (b, s, heads * 3 * dh), head by head.

    causal: token i attends to tokens 0..i only (a decoder, as GPT)."""
    b, s, _ = qkv.shape
    q, k, v = qkv.view(b, s, -1, 3, head_dim).permute(3, 0, 2, 1, 4)  # each (b, heads, s, dh)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    if causal:
        future = torch.ones(s, s, dtype=torch.bool, device=qkv.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool = False):
        super().__init__()
        require_divisible("d (model width, split into heads)", d, heads)
        self.head_dim, self.causal = d // heads, causal
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        return self.out(attention(self.qkv(x), self.head_dim, self.causal))


class TransformerLayer(nn.Module):
    """Pre-LayerNorm: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, d: int, heads: int, hidden: int, causal: bool = False):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), SelfAttention(d, heads, causal)
        self.ln2, self.mlp = nn.LayerNorm(d), MLP(d, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


# ------------------------------------------------------------------------------ parallel blocks

def _part(full, name):
    return None if full is None else getattr(full, name)


class ParallelMLP(nn.Module):
    """fc1 column-parallel, GELU on the split features, fc2 row-parallel: one f and one g.

    sequence_parallel: the input and output are sequence shards (b, s/t, d): all-gather in,
    reduce-scatter out.
    """

    def __init__(self, d: int, hidden: int, group=None, sequence_parallel: bool = False,
                 full: MLP | None = None):
        super().__init__()
        check_same_shape("ParallelMLP", (d, hidden, int(sequence_parallel)), group,
                         ("d", "hidden", "sequence_parallel"))
        self.fc1 = ColumnParallelLinear(d, hidden, group=group, full=_part(full, "fc1"),
                                        input_comm="gather" if sequence_parallel else "copy")
        self.fc2 = RowParallelLinear(hidden, d, group=group, full=_part(full, "fc2"),
                                     output_comm="scatter" if sequence_parallel else "reduce")

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelSelfAttention(nn.Module):
    """Heads split over ranks: QKV column-parallel (whole heads per rank), output row-parallel."""

    def __init__(self, d: int, heads: int, group=None, sequence_parallel: bool = False,
                 full: SelfAttention | None = None, causal: bool = False):
        super().__init__()
        _, size = tp_world(group)
        # every size that shapes the attention, before a rank's own checks can fail alone
        check_same_shape("ParallelSelfAttention", (d, heads, d // heads if heads > 0 else 0,
                                                   int(sequence_parallel)), group,
                         ("d", "heads", "head_dim", "sequence_parallel"))
        require_divisible("d (model width, split into heads)", d, heads)
        require_divisible("heads", heads, size)
        self.head_dim, self.causal = d // heads, causal if full is None else full.causal
        self.qkv = ColumnParallelLinear(d, 3 * d, group=group, full=_part(full, "qkv"),
                                        input_comm="gather" if sequence_parallel else "copy")
        self.out = RowParallelLinear(d, d, group=group, full=_part(full, "out"),
                                     output_comm="scatter" if sequence_parallel else "reduce")

    def forward(self, x):
        return self.out(attention(self.qkv(x), self.head_dim, self.causal))


class ParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm on replicated activations, or on sequence shards (its gradient then partial)."""

    def __init__(self, d: int, sequence_parallel: bool = False, full: nn.LayerNorm | None = None):
        super().__init__(d)
        if full is not None:
            self.load_state_dict(full.state_dict())
        for p in self.parameters():
            p.tp_dim, p.sequence_parallel = None, sequence_parallel


class ParallelTransformerLayer(nn.Module):
    """Megatron's layer: 2 all-reduces forward, 2 backward; or, sequence parallel, 2 (all-gather,
    reduce-scatter) pairs each way with LayerNorms and residuals on s/t tokens."""

    def __init__(self, d: int, heads: int, hidden: int, group=None, sequence_parallel: bool = False,
                 full: TransformerLayer | None = None, causal: bool = False):
        super().__init__()
        sp = sequence_parallel
        self.ln1 = ParallelLayerNorm(d, sp, _part(full, "ln1"))
        self.attn = ParallelSelfAttention(d, heads, group, sp, _part(full, "attn"), causal)
        self.ln2 = ParallelLayerNorm(d, sp, _part(full, "ln2"))
        self.mlp = ParallelMLP(d, hidden, group, sp, _part(full, "mlp"))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


# ----------------------------------------------------------------------------------- gradients

def sync_sequence_parallel_grads(module: nn.Module, group=None) -> int:
    """Sum the partial gradients of sequence-parallel parameters over the group (one all-reduce).

    Call after ``backward()``, before the optimizer step; returns how many parameters it summed.
    """
    grads = [p.grad for p in module.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    _, size = tp_world(group)
    if not grads or size == 1:
        return len(grads)
    flat = torch.cat([g.reshape(-1) for g in grads])
    record_comm("all_reduce", "backward", flat.numel() * flat.element_size(), size)
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
    return len(grads)


def gather_full(module: nn.Module, grads: bool = False, group=None) -> dict[str, torch.Tensor]:
    """The single-device state dict (or gradients) rebuilt from every rank's parts.

    A collective: every rank of ``group`` must call it."""
    _, size = tp_world(group)
    out = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            raise ValueError(f"{name} has no gradient: run backward() before "
                             "gather_full(grads=True)")
        dim = getattr(p, "tp_dim", None)
        if dim is not None and size > 1:
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim)
        out[name] = t.clone()
    return out
