"""Process groups from a grid of ranks: the picture behind a 2D (or 3D) mesh.

Lay the world's ranks out as a tensor, ``grid = arange(world).view(dp, tp)`` (picotron's way; add
``pp`` for three dimensions). Along a named dimension, the ranks that agree on every *other* index
form one group: with world 4 and (dp, tp) = (2, 2),

    grid = [[0, 1],      tp groups (rows, same dp index):    [0, 1], [2, 3]
            [2, 3]]      dp groups (columns, same tp index): [0, 2], [1, 3]

Rank r sits at ``coords = unravel(r)``; its group along a dimension is the line of the grid through r
along that dimension. Tensor parallelism uses the tp group (neighbouring ranks, the fast links of one
node), data parallelism or FSDP the dp group. ``torch.distributed.device_mesh.init_device_mesh``
builds exactly these groups; ``Mesh`` builds them by hand with ``dist.new_group``, with no global
state: every rank must build every group, in the same order, even those it is not in.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["grid", "groups_along", "Mesh"]


def grid(world: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``arange(world).view(shape)``, with an error that says what to change when it does not fit."""
    if any(s < 1 for s in shape) or math.prod(shape) != world:
        raise ValueError(f"a mesh of shape {tuple(shape)} holds {math.prod(shape)} ranks, but the "
                         f"world has {world}: choose sizes whose product is {world}")
    return torch.arange(world).view(*shape)


def groups_along(g: torch.Tensor, dim: int) -> list[list[int]]:
    """Every group of ranks along ``dim``: the lines of the grid in that direction."""
    lines = g.movedim(dim, -1).reshape(-1, g.shape[dim])
    return [row.tolist() for row in lines]


class Mesh:
    """Named process groups of this rank, built from ``grid(world, shape)``; call it on every rank."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...]):
        if len(shape) != len(names) or len(set(names)) != len(names):
            raise ValueError(f"give one distinct name per dimension: shape {tuple(shape)}, names "
                             f"{tuple(names)}")
        if not dist.is_initialized():
            raise RuntimeError("Mesh builds process groups, and no process group is initialised: "
                               "run it on ranks started by d2lpar.processes.launch.launch or torchrun")
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.grid, self.names = grid(world, tuple(shape)), tuple(names)
        self.coords = tuple(int(i) for i in (self.grid == self.rank).nonzero()[0])
        self._groups, self._ranks = {}, {}
        for d, name in enumerate(self.names):
            for ranks in groups_along(self.grid, d):
                group = dist.new_group(ranks)  # collective: every rank creates every group
                if self.rank in ranks:
                    self._groups[name], self._ranks[name] = group, ranks

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group along ``name``."""
        return self._ranks[self._check(name)]

    def group(self, name: str):
        return self._groups[self._check(name)]

    def _check(self, name: str) -> str:
        if name not in self.names:
            raise KeyError(f"no dimension {name!r} in this mesh: it has {', '.join(self.names)}")
        return name
