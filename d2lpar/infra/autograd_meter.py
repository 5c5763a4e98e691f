"""What a training step costs, measured on any device: bytes autograd saves, and FLOPs.

``saved_bytes(fn)`` runs ``fn()`` (a forward pass returning a tensor) under
``torch.autograd.graph.saved_tensors_hooks`` and adds up every tensor saved for the backward pass,
once each, leaving out the ``exclude`` modules' parameters (they exist with or without training).
Activation checkpointing changes what is saved: a checkpointed region saves only its inputs (torch
stores them through ``save_for_backward``, which the hooks see); selective checkpointing saves the
outputs its policy keeps (seen when it is called with ``respect_saved_tensors_hooks=True``).

``count_flops(fn)`` runs ``fn()`` under ``torch.utils.flop_counter.FlopCounterMode`` and returns the
FLOPs of the matrix products it ran (forward and backward, recomputation included); elementwise
operations, softmax and normalisation are not counted, as in every published FLOP count.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["saved_bytes", "count_flops", "peak_live_bytes"]


def saved_bytes(fn, *exclude: nn.Module) -> int:
    """Bytes of the tensors saved for backward while ``fn()`` runs (a tensor saved twice counts
    once, keyed by the address of its first element: a slice of a bigger tensor counts its own
    elements)."""
    params = {p.untyped_storage().data_ptr() for m in exclude for p in m.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(saved.values())


def count_flops(fn) -> int:
    """Matmul FLOPs of ``fn()`` (run it forward and backward inside ``fn`` to count both)."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def peak_live_bytes(fn) -> int:
    """The peak, while ``fn()`` runs, of the bytes of tensors created inside it and still alive.

    A ``TorchDispatchMode`` sees every tensor an operation returns; a weak reference to its storage
    says when the storage is freed. Tensors made before ``fn`` (parameters, inputs) are not counted,
    so run the forward *and* the backward inside ``fn`` (e.g. ``torch.autograd.grad(loss, x)``,
    which makes no parameter gradients) to measure the activations, the recomputed segments and the
    backward's temporaries at their highest."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    live: dict[int, int] = {}
    state = {"now": 0, "peak": 0}

    def free(key: int) -> None:
        state["now"] -= live.pop(key, 0)

    class Meter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      # a view or an in-place result is no new memory
                      if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    key = st.data_ptr()
                    if st.nbytes() and key not in live and key not in inputs:
                        live[key] = st.nbytes()
                        state["now"] += st.nbytes()
                        weakref.finalize(st, free, key)
            state["peak"] = max(state["peak"], state["now"])
            return out

    with Meter():
        fn()
    return state["peak"]
