"""Groups built by hand from a grid of ranks equal the groups of init_device_mesh."""

import pytest
import torch
import torch.distributed as dist

from d2lpar.processes.launch import launch
from d2lpar.strategies.sharded import mesh as M


def test_grid_lines_without_processes():
    g = M.grid(8, (2, 2, 2))
    assert M.groups_along(M.grid(4, (2, 2)), 0) == [[0, 2], [1, 3]]
    assert M.groups_along(M.grid(4, (2, 2)), 1) == [[0, 1], [2, 3]]
    assert M.groups_along(g, 1) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    every = sorted(r for line in M.groups_along(g, 2) for r in line)
    assert every == list(range(8))
    with pytest.raises(ValueError, match="product is 6"):
        M.grid(6, (4, 2))


def _compare():
    from torch.distributed.device_mesh import init_device_mesh
    ours = M.Mesh((2, 2), ("dp", "tp"))
    theirs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x, group=ours.group("tp"))  # sums over our tp group only
    return {name: (ours.ranks(name), dist.get_process_group_ranks(theirs.get_group(name)))
            for name in ("dp", "tp")} | {"coords": (ours.coords, tuple(theirs.get_coordinate())),
                                         "tp_sum": x.item()}


def test_hand_built_groups_equal_the_device_mesh():
    for rank, out in enumerate(launch(_compare, 4, timeout=60)):
        for key in ("dp", "tp", "coords"):
            assert out[key][0] == out[key][1], (rank, key)
        assert out["tp_sum"] == sum(out["tp"][0]) != sum(range(4))  # the group, not the world
