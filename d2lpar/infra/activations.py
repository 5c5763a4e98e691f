"""Activation memory, measured: the bytes autograd keeps between a forward pass and its backward.

Every operation that needs its input (or output) to compute a gradient *saves* that tensor on the
autograd graph; those saved tensors are the activation memory of training, and they live until the
backward pass frees them. ``torch.autograd.graph.saved_tensors_hooks`` sees each one as it is saved,
so counting them measures activation memory on any device, CPU included, with no profiler. Strategies
(pipeline stages, tensor-parallel blocks, data parallelism's per-device batches) check their
activation formulas against this measurement.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["saved_activation_bytes"]


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward pass of ``model(x)`` (parameters not counted).

    A tensor saved by two operations counts once; a slice counts its own elements.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # Key by the address of the first element: the same tensor saved twice counts once, and a
        # slice of a bigger tensor counts its own elements, not the whole storage.
        if t.untyped_storage().data_ptr() not in params:
            saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()  # sum saves nothing: its backward only needs the shape
    return sum(saved.values())
