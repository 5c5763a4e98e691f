"""Activation memory, measured: the bytes autograd keeps between a forward pass and its backward.

Every operation that needs its input (or output) to compute a gradient *saves* that tensor on the
autograd graph; those saved tensors are the activation memory of training, and they live until the
backward pass frees them. ``torch.autograd.graph.saved_tensors_hooks`` sees each one as it is saved,
so counting them measures activation memory on any device, CPU included, with no profiler. Strategies
(pipeline stages, tensor-parallel blocks, data parallelism's per-device batches) check their
activation formulas against this measurement.

``SavedTensors`` follows the same bytes over time: a tensor counts from the moment it is saved until
autograd lets go of it (after the backward that used it, or when its graph is dropped), so a
pipeline stage that runs several micro-batches' forwards before their backwards shows its activation
memory rising and falling, and ``peak`` is the most it held at once.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from d2lpar.infra.autograd_meter import saved_bytes

__all__ = ["saved_activation_bytes", "SavedTensors"]


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward pass of ``model(x)`` (parameters not counted).

    A tensor saved by two operations counts once; a slice counts its own elements.
    """
    # sum saves nothing: its backward needs only a shape
    return saved_bytes(lambda: model(x).sum(), model)


class _Held:
    """What the graph keeps instead of a saved tensor; when autograd drops it, its bytes are freed."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensors:
    """Bytes of saved tensors alive now (``current``) and at most (``peak``), over many passes.

    ``with tracker:`` counts what forwards save inside the block; the bytes are released when
    autograd frees them, inside or outside the block. Parameters of ``exclude`` modules are not
    counted; a tensor saved twice (or a view of the same first element) counts once.
    """

    def __init__(self, *exclude: nn.Module):
        self._params = {p.untyped_storage().data_ptr() for m in exclude for p in m.parameters()}
        self._live: dict[int, list[int]] = {}   # data_ptr -> [bytes, references]
        self.current = self.peak = 0
        self._hooks = None

    def _release(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[ptr]

    def _pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self._params:
            return t
        ptr, size = t.data_ptr(), t.numel() * t.element_size()
        entry = self._live.setdefault(ptr, [0, 0])
        if entry[1] == 0 or size > entry[0]:
            self.current += size - entry[0]
            entry[0] = size
        entry[1] += 1
        self.peak = max(self.peak, self.current)
        held = _Held(t.detach())  # detached: holding the output itself would make a cycle through its grad_fn
        weakref.finalize(held, self._release, ptr)
        return held

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def reset_peak(self) -> None:
        self.peak = self.current

    def __enter__(self) -> "SavedTensors":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
