"""Flat padded shards: a group of parameters as views into one buffer that N ranks can split evenly.

ZeRO and FSDP shard *units* (usually one layer each). A unit's parameters, of Psi_unit elements in
all, are copied into one flat buffer of N S elements, S = ceil(Psi_unit / N), and become views into
it; the last N S - Psi_unit elements are padding, zero. Every rank's shard then has exactly S elements
whatever Psi and N, so reduce-scatter and all-gather move equal chunks, and a collective on the flat
buffer is one message per step instead of one per tensor. The course's ring leaves rank r with chunk
(r+1) mod N after a reduce-scatter, so that is the shard rank r owns: ``own(flat)`` is its slice.

``split_units`` chooses the units: each child module that owns trainable parameters (the children
of a ``ModuleList`` or ``ModuleDict``, which is never called itself, are units of their own);
parameters shared between children (tied weights) and the root's own go into a root unit, which
stays gathered through the whole forward and backward (FSDP2 does the same for its root).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["shard_size", "padded_numel", "FlatUnit", "split_units", "CONTAINERS"]

CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # hold layers but have no forward: never called


def shard_size(numel: int, n: int) -> int:
    """Elements per shard when ``numel`` elements are cut into n equal, padded shards: ceil(numel/n)."""
    return -(-numel // n)


def padded_numel(unit_numels, n: int) -> int:
    """Psi as ZeRO stores it: every unit padded to a multiple of n."""
    return sum(n * shard_size(u, n) for u in unit_numels)


class FlatUnit:
    """A group of parameters sharded together: one flat padded buffer, one shard of it per rank."""

    def __init__(self, name: str, module: nn.Module | None, params: list[nn.Parameter], n: int,
                 rank: int, reshard: bool, dtype: torch.dtype | None = None):
        self.name, self.module, self.params, self.reshard = name, module, params, reshard
        self.numel = sum(p.numel() for p in params)
        self.S = shard_size(self.numel, n)
        self.padded = n * self.S
        self.lo = (rank + 1) % n * self.S  # the ring finishes chunk (rank+1) mod N on this rank
        first = params[0]
        self.full = torch.zeros(self.padded, dtype=dtype or first.dtype, device=first.device)
        self.views, self.offsets, start = [], [], 0
        for p in params:
            self.views.append(self.full[start:start + p.numel()].view_as(p))
            self.offsets.append(start)
            start += p.numel()
        self.gathered, self.ready, self.reduced = True, 0, False
        self.had = [False] * len(params)  # which parameters got a gradient this step, on this rank

    def pieces(self) -> list[tuple[int, int, int | None]]:
        """This rank's shard cut by parameter: (start, stop, index in params or None: padding)."""
        out = []
        for i, (v, o) in enumerate(zip(self.views, self.offsets)):
            a, b = max(o, self.lo), min(o + v.numel(), self.lo + self.S)
            if a < b:
                out.append((a - self.lo, b - self.lo, i))
        if self.lo + self.S > max(self.lo, self.numel):
            out.append((max(self.lo, self.numel) - self.lo, self.S, None))
        return out

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.lo:self.lo + self.S]

    @property
    def nbytes(self) -> int:
        return self.padded * self.full.element_size()


def _callable_children(module: nn.Module, prefix: str = ""):
    """(name, child) for every child that gets called: a ModuleList's or ModuleDict's own children
    instead of the container; a ParameterList or ParameterDict is no layer (its owner uses it)."""
    for name, child in module.named_children():
        if isinstance(child, CONTAINERS):
            yield from _callable_children(child, f"{prefix}{name}.")
        elif not isinstance(child, (nn.ParameterList, nn.ParameterDict)):
            yield prefix + name, child


def split_units(module: nn.Module, trainable: list[nn.Parameter]):
    """Default units: each called child that owns trainable parameters; shared and direct ones (and
    those of a ParameterList) go to the root."""
    owners: dict[int, set] = {}
    children = list(_callable_children(module))
    for cname, child in children:
        for p in child.parameters():
            owners.setdefault(id(p), set()).add(cname)
    units, placed = [], set()
    for cname, child in children:
        ps = [p for p in child.parameters() if p.requires_grad and owners[id(p)] == {cname}]
        if ps:
            units.append((cname, child, ps))
            placed.update(id(p) for p in ps)
    rest = [p for p in trainable if id(p) not in placed]
    return ([("(root)", module, rest)] if rest else []) + units
