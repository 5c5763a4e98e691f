"""What a sharded run promises, checked so that the check can fail.

* **Mixed precision trains close to fp32.** "Close" must be measured against how far training moved
  the weights: three AdamW steps at lr 1e-2 move a weight by at most about 0.03, so an absolute
  tolerance of 0.05 also passes a run that never trained. ``movement_error(got, want, start)`` is
  ``||got - want|| / ||want - start||`` over all the weights at once: the error as a fraction of the
  movement. (Not element by element: Adam's first steps move every weight by about lr whatever the
  size of its gradient, so bf16's rounding can flip the direction of a weight whose gradient is
  near 0, and a few such weights are off by nearly their whole movement.) A run that never trained,
  or took twice fp32's steps, is at 1; half of them at 0.5. ``check_mixed_precision`` asserts it is
  above 0 (bf16 is not fp32) and below a limit (0.35 by default).
* **Gradient accumulation skips the reduce-scatter.** With ``set_requires_gradient_sync(False)`` on
  every micro-batch but the last, FSDP2 runs no reduce-scatter during those micro-batches and one
  per unit (``fully_shard``-ed module with parameters) on the last. ``check_accumulation`` asserts
  both from the collectives counted during each micro-batch (``CommDebugMode``, under our names:
  ``d2lpar.strategies.tensor.mappings.torch_counts``).
* **The all-gathers move bf16.** ``CollectiveDtypes`` is a ``CommDebugMode`` that also records the
  dtype and bytes of the tensors handed to each c10d collective (``_allgather_base_`` gets its output
  and its input, ``_reduce_scatter_base_`` too), so a check reads what went on the wire, not the dtype
  a layer computes in (an FSDP that all-gathered fp32 and cast afterwards would compute in bf16 too).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch.distributed.tensor.debug import CommDebugMode

from d2lpar.infra.check import check

__all__ = ["movement_error", "check_mixed_precision", "check_accumulation", "CollectiveDtypes"]


class CollectiveDtypes(CommDebugMode):
    """``CommDebugMode`` that also records, for each c10d collective, what it was handed:
    ``handed[op] = [(dtype, bytes), ...]`` for its tensor arguments, in order (output, input)."""

    def __init__(self):
        super().__init__()
        self.handed: dict[str, list[tuple[str, int]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") == "c10d":
            op = str(func._overloadpacket).split(".")[-1]
            self.handed.setdefault(op, []).extend(
                (str(t.dtype).replace("torch.", ""), t.numel() * t.element_size())
                for t in args if isinstance(t, torch.Tensor))
        return super().__torch_dispatch__(func, types, args, kwargs)


def movement_error(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                   start: Mapping[str, torch.Tensor]) -> float:
    """||got - want|| / ||want - start|| over every tensor at once (error over movement)."""
    error = sum((got[k].float() - w.float()).pow(2).sum() for k, w in want.items())
    moved = sum((w.float() - start[k].float()).pow(2).sum() for k, w in want.items())
    if moved == 0:
        raise ValueError("the weights did not move from their start: train before comparing runs")
    return (error / moved).sqrt().item()


def check_mixed_precision(got, want, start, limit: float = 0.35) -> float:
    """Assert 0 < movement_error < limit; print the verdict; return the fraction."""
    err = movement_error(got, want, start)
    check(f"bf16 differs from fp32 by under {limit:.0%} of how far fp32 moved the weights, not 0",
          0 < err < limit, f"error / movement = {err:.3g}")
    return err


def check_accumulation(per_micro_batch: list[Mapping[str, int]], units: int) -> None:
    """Assert no reduce-scatter before the last micro-batch and ``units`` on the last."""
    early = [c.get("reduce_scatter", 0) for c in per_micro_batch[:-1]]
    last = per_micro_batch[-1].get("reduce_scatter", 0)
    check(f"accumulating: no reduce-scatter in the first {len(early)} micro-batch(es)",
          len(early) > 0 and not any(early), f"reduce-scatters per micro-batch: {early}")
    check(f"the last micro-batch reduce-scatters once per unit ({units})", last == units,
          f"{last} reduce-scatters")
