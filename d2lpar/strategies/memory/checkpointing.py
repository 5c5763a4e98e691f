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

**Running statistics.** torch's checkpoint recomputes by running the forward again, and a
BatchNorm in training mode updates its running mean and variance (and ``num_batches_tracked``) on
every forward: recomputed, it would update them twice per step. ``CheckpointedStack`` runs each
recomputation in a context that puts those buffers back as they were when it began, so they equal
the plain model's. Selective checkpointing keeps the matmuls' outputs for the backward, so a layer
that changes its input in place (``ReLU(inplace=True)``) would change a kept tensor: refused.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

__all__ = ["MATMULS", "save_ops_policy", "running_stats", "KeepRunningStats", "CheckpointedStack"]

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


def running_stats(module: nn.Module) -> list[torch.Tensor]:
    """The buffers a forward in training mode updates: BatchNorm's (and InstanceNorm's, with
    ``track_running_stats``) running mean, variance and batch count."""
    return [t for m in module.modules() if m.training and getattr(m, "track_running_stats", False)
            for t in (m.running_mean, m.running_var, m.num_batches_tracked) if t is not None]


class KeepRunningStats:
    """The recomputation's context: on exit, the running statistics of ``module`` are put back as
    they were on entry (around ``inner``, selective checkpointing's own context)."""

    def __init__(self, module: nn.Module, inner=None):
        self.module, self.inner = module, inner or contextlib.nullcontext()

    def __enter__(self):
        self.saved = [(t, t.clone()) for t in running_stats(self.module)]
        return self.inner.__enter__()

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            with torch.no_grad():
                for t, before in self.saved:
                    t.copy_(before)


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
        for name, m in self.named_modules() if mode == "selective" else ():
            if getattr(m, "inplace", False) is True:
                raise ValueError(f"selective checkpointing keeps the outputs of the ops it saves, "
                                 f"and {name} ({m}) changes its input in place (torch then stops "
                                 f"the backward): use inplace=False, or mode='full'")

    def _contexts(self, modules, selective: bool):
        """checkpoint's context_fn: the forward's and the recomputation's contexts."""
        forward, recompute = (create_selective_checkpoint_contexts(self.policy) if selective
                              else (contextlib.nullcontext(), None))
        return forward, KeepRunningStats(modules, recompute)

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
                segment = self.layers[start:start + self.every]
                x = checkpoint(self._segment, start, x, use_reentrant=False,
                               context_fn=functools.partial(self._contexts, segment, False))
            return x
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False, respect_saved_tensors_hooks=True,
                           context_fn=functools.partial(self._contexts, layer, True))
        return x
