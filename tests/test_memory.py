import pytest
import torch

from d2lpar.cost.memory import STRATEGIES, footprints, mlp_activation_bytes, partition_layers
from d2lpar.infra.activations import saved_activation_bytes
from d2lpar.infra.models import lenet, mlp

SIZES = (784, 128, 64, 32, 10)


@pytest.mark.parametrize("batch", [1, 8, 33])
def test_measured_activations_match_the_formula(batch):
    x = torch.randn(batch, 1, 28, 28)
    assert saved_activation_bytes(mlp(SIZES), x) == mlp_activation_bytes(SIZES, batch)


def test_measured_activations_grow_linearly_with_the_batch():
    m = lenet()
    small, big = (saved_activation_bytes(m, torch.randn(b, 1, 28, 28)) for b in (4, 8))
    assert big > small > 0


def test_data_parallel_splits_activations_but_copies_the_model():
    single = footprints(SIZES, 64, 1, "single")[0]
    data = footprints(SIZES, 64, 4, "data")
    assert sum(f.activations for f in data) == single.activations
    assert all(f.params == single.params and f.optimizer == 2 * single.params for f in data)
    assert sum(f.total for f in data) > single.total
    ring = 2 * 3 / 4 * single.params
    assert all(f.sent == int(ring) for f in data)


def test_uneven_batch_uses_largest_remainder():
    data = footprints(SIZES, 10, 4, "data", optimizer="sgd")
    per_sample = mlp_activation_bytes(SIZES, 1)
    assert [f.activations // per_sample for f in data] == [3, 3, 2, 2]
    assert all(f.optimizer == 0 for f in data)


@pytest.mark.parametrize("strategy", ["model", "pipeline-gpipe", "pipeline-1f1b", "channel"])
def test_model_splits_hold_each_parameter_once(strategy):
    single = footprints(SIZES, 64, 1, "single")[0]
    parts = footprints(SIZES, 64, 2, strategy)
    assert sum(f.params for f in parts) == single.params
    assert all(f.sent > 0 for f in parts)


def test_pipeline_1f1b_keeps_fewer_activations_than_gpipe():
    g = footprints(SIZES, 64, 4, "pipeline-gpipe", micro_batches=8)
    f = footprints(SIZES, 64, 4, "pipeline-1f1b", micro_batches=8)
    assert sum(x.activations for x in f) < sum(x.activations for x in g)


def test_channel_sends_an_all_gather_forward_and_a_reduce_scatter_backward():
    batch, n = 64, 4
    hidden = sum(SIZES[1:-1])
    one_pass = 4 * batch * hidden * (n - 1) / n     # one ring pass over every hidden output
    final = 4 * batch * SIZES[-1] * (n - 1) / n      # the output, all-gathered for the loss
    assert all(f.sent == int(2 * one_pass + final) for f in footprints(SIZES, batch, n, "channel"))


def test_tensor_keeps_the_inner_activation_split_and_sends_at_pair_boundaries():
    batch, n = 64, 4
    t, c = footprints(SIZES, batch, n, "tensor"), footprints(SIZES, batch, n, "channel")
    inner = 4 * batch * (SIZES[1] + SIZES[3])                  # inputs of the row layers
    assert all(c[0].activations - f.activations == inner - inner // n for f in t)
    ar = lambda d: 2 * (n - 1) / n * 4 * batch * d
    assert all(f.sent == int(2 * ar(SIZES[2]) + ar(SIZES[4])) for f in t)
    rows_bias = SIZES[2] + SIZES[4]                           # whole on every device
    P = sum(a * b + b for a, b in zip(SIZES[:-1], SIZES[1:]))
    assert sum(f.params for f in t) // 4 == P + (n - 1) * rows_bias
    with pytest.raises(ValueError, match="odd"):
        footprints((8, 4, 4, 2), 8, 2, "tensor")


def test_data_plus_model():
    parts = footprints(SIZES, 64, 4, "data+model", replicas=2)
    single = footprints(SIZES, 64, 1, "single")[0]
    assert len(parts) == 4 and sum(f.params for f in parts) == 2 * single.params
    assert sum(f.activations for f in parts) == single.activations


def test_partition_is_balanced_and_contiguous():
    groups = partition_layers((100, 100, 100, 100, 100), 2)
    assert groups == [[0, 1], [2, 3]]
    assert sum(partition_layers(SIZES, 3), []) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot split 4 layers into 5"):
        partition_layers(SIZES, 5)


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        footprints(SIZES, 64, 2, "zero")
    with pytest.raises(ValueError, match="sgd, momentum or adam"):
        footprints(SIZES, 64, 2, "data", optimizer="lamb")
    with pytest.raises(ValueError, match="at least n samples"):
        footprints(SIZES, 2, 4, "data")
    assert set(STRATEGIES) >= {"data", "model", "channel"}


def test_slices_count_their_own_elements():
    X = torch.randn(100, 1, 28, 28)
    parts = sum(saved_activation_bytes(mlp(SIZES), p) for p in X[:40].split(10))
    assert parts == saved_activation_bytes(mlp(SIZES), X[:40]) == mlp_activation_bytes(SIZES, 40)
