import pytest
import torch
from torch import nn

from d2lpar.cost.autopar import (Graph, data_parallel_graph, draw_graph, forward_graph,
                                 independent_parts, list_schedule)
from d2lpar.infra.models import mlp


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.right = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.cat([self.left(x), self.right(x)], dim=1))


def test_chain_has_no_independent_parts_and_branches_do():
    assert independent_parts(forward_graph(mlp((8, 4, 2)), torch.randn(3, 8))) == []
    parts = independent_parts(forward_graph(TwoTower(), torch.randn(3, 8)))
    assert sorted(len(p) for p in parts) == [3, 3]
    assert {p[0].split(".")[0] for p in parts} == {"left", "right"}


def test_flops_of_a_linear_layer():
    g = forward_graph(mlp((8, 4, 2)), torch.randn(3, 8))
    assert g.ops["linear1"].flops == 2 * 3 * 8 * 4 and g.ops["linear1"].params == 8 * 4 + 4


def test_scheduler_puts_branches_side_by_side():
    g = forward_graph(TwoTower(), torch.randn(64, 8))
    one, _ = list_schedule(g, ["dev0"], speed=1e6)
    two, where = list_schedule(g, ["dev0", "dev1"], speed=1e6, bandwidth=1e12)
    left = {where[n] for n in g.ops if n.startswith("left")}
    right = {where[n] for n in g.ops if n.startswith("right")}
    assert len(left) == len(right) == 1 and left != right
    assert two.makespan() < one.makespan()
    assert one.makespan() == pytest.approx(sum(op.flops for op in g.ops.values()) / 1e6)
    # a slow link keeps everything on one device
    _, where = list_schedule(g, ["dev0", "dev1"], speed=1e6, bandwidth=1.0)
    assert len(set(where.values())) == 1


def test_data_parallel_graph_overlaps_gradient_copies_with_backward():
    g = data_parallel_graph(mlp((784, 256, 10)), torch.randn(64, 1, 28, 28))
    parts = independent_parts(g)
    assert len(parts) == 1 or all(len(p) > 1 for p in parts)
    assert g.independent("linear1@gpu0", "linear1@gpu1")
    tl, where = list_schedule(g, ["gpu0", "gpu1"], speed=1e9, bandwidth=1e9)
    assert where["grad linear1@gpu0"] == "gpu0" and where["update linear1"] == "cpu"
    assert tl.overlap("gpu0", "cpu<->gpu0") > 0  # the last layer's gradient travels during backward
    assert tl.makespan() >= g.critical_path(lambda op: op.flops / 1e9 + (
        op.nbytes / 1e9 if op.kind == "copy" else 0)) - 1e-12


def test_graph_rejects_bad_order():
    g = Graph()
    g.add("a")
    with pytest.raises(ValueError, match="already"):
        g.add("a")
    with pytest.raises(ValueError, match="not in the graph yet"):
        g.add("c", ["b"])


def test_draw_graph_runs():
    import matplotlib
    matplotlib.use("Agg")
    ax = draw_graph(forward_graph(TwoTower(), torch.randn(3, 8)))
    assert ax is not None
