"""Activation checkpointing: keep less for the backward pass, and compute the rest again.

A forward pass saves, for every operation, what its backward needs (``d2lpar.infra.autograd_meter``
measures it). ``torch.utils.checkpoint.checkpoint(f, x)`` runs ``f`` without saving anything inside
it except its input ``x``; when the backward pass reaches ``f`` it runs ``f(x)`` again, this time
saving, and backpropagates through that. Three ways to use it on a stack of L layers:

* **full, every k layers**: segments of k layers, each checkpointed: ceil(L/k) inputs kept, one
  segment's activations held again during its backward, and one extra forward pass of compute;
* **selective**: inside each layer, a *policy* says per operation whether to save its output
  (``CheckpointPolicy.MUST_SAVE``) or recompute it (``PREFER_RECOMPUTE``), through
  ``create_selective_checkpoint_contexts``. Saving the matrix products and recomputing the cheap
  rest (normalisations, GELU, softmax, the attention's two batched products) keeps most of the
  compute and drops the largest tensors (the b x a x s x s attention scores);
* **none**: everything saved, nothing recomputed.

The gradients are the same in all three: recomputation repeats the same operations on the same
inputs (bitwise on the CPU; a GPU's non-deterministic kernels may differ in the last bits).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

__all__ = ["MATMULS", "save_ops_policy", "CheckpointedStack"]

# What "save the matmuls" saves: the linear layers' products (a Linear on a 3-D input is an addmm
# or mm on its 2-D view). The attention's batched products (bmm) are recomputed.
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def save_ops_policy(ops):
    """A selective-checkpointing policy that saves the outputs of ``ops`` and recomputes the
    rest."""
    ops = tuple(ops)
    if not ops:
        raise ValueError("a selective checkpointing policy that saves no op recomputes everything, "
                         "which is full checkpointing: name the ops to save (e.g. MATMULS), or use "
                         "mode='full'")
    bad = [op for op in ops if not isinstance(op, torch._ops.OpOverload)]
    if bad:
        raise ValueError(f"{bad[0]!r} is not an aten op overload: name ops as "
                         "torch.ops.aten.mm.default")

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


class CheckpointedStack(nn.Module):
    """Run ``layers`` one after the other, checkpointed by ``mode``: 'none', 'full' (segments of
    ``every`` layers) or 'selective' (each layer, saving the outputs of ``save_ops``)."""

    def __init__(self, layers, mode: str = "none", every: int = 1, save_ops=MATMULS):
        super().__init__()
        if mode not in ("none", "full", "selective"):
            raise ValueError(f"mode={mode!r}: use 'none', 'full' or 'selective'")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r}: checkpoint segments of at least 1 layer")
        self.layers, self.mode, self.every = nn.ModuleList(layers), mode, every
        self.policy = save_ops_policy(save_ops) if mode == "selective" else None

    def _segment(self, start: int, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[start:start + self.every]:
            x = layer(x)
        return x

    def forward(self, x):
        if self.mode == "none":
            return self._segment(0, x) if self.every >= len(self.layers) else \
                functools.reduce(lambda h, layer: layer(h), self.layers, x)
        if self.mode == "full":
            for start in range(0, len(self.layers), self.every):
                x = checkpoint(self._segment, start, x, use_reentrant=False)
            return x
        context = functools.partial(create_selective_checkpoint_contexts, self.policy)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False, context_fn=context,
                           respect_saved_tensors_hooks=True)
        return x
