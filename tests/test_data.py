import pytest
import torch

from d2lpar.infra.data import chunk_bounds, even_sizes, split_batch, split_sizes


@pytest.mark.parametrize("b,n", [(8, 2), (10, 3), (7, 7), (1000, 8), (9, 4)])
def test_even_split(b, n):
    sizes = split_sizes(b, n)
    assert sum(sizes) == b and len(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True), "the extra examples go to the first devices"


def test_proportional_split():
    assert split_sizes(16, weights=[2, 3, 3]) == [4, 6, 6]  # the seeds' BalancedDataParallel case
    assert split_sizes(16, weights=[1, 2, 2]) == [3, 7, 6]  # 3.2, 6.4, 6.4: largest remainder
    assert split_sizes(8, weights=[2, 3, 3]) == [2, 3, 3]
    sizes = split_sizes(100, weights=[0.3, 0.3, 0.4])
    assert sum(sizes) == 100 and sizes == [30, 30, 40]


def test_batch_smaller_than_devices():
    with pytest.raises(ValueError, match="batch of 3 cannot be split over 4 devices"):
        split_sizes(3, 4)


def test_weights_that_starve_a_device():
    with pytest.raises(ValueError, match="leave a device with no examples"):
        split_sizes(4, weights=[100, 1])


def test_split_batch_on_cpu_devices():
    X, y = torch.arange(20.).view(10, 2), torch.arange(10)
    devs = [torch.device("cpu", i) for i in range(3)]
    xs, ys = split_batch(X, y, devs)
    assert [len(p) for p in xs] == [4, 3, 3]
    assert torch.equal(torch.cat(xs), X) and torch.equal(torch.cat(ys), y)
    assert len(split_batch(X, None, devs)) == 3


def test_split_batch_mismatch():
    with pytest.raises(ValueError, match="must match"):
        split_batch(torch.zeros(4, 1), torch.zeros(3), [torch.device("cpu")] * 2)


def test_one_cutting_rule_for_batches_and_tensors():
    assert chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]  # a short tensor: empty chunks
    for total, n in [(7, 3), (10, 4), (1000, 8)]:
        assert split_sizes(total, n) == even_sizes(total, n) == [b - a for a, b in chunk_bounds(total, n)]
    with pytest.raises(ValueError, match="n >= 1"):
        chunk_bounds(4, 0)


def test_split_batch_with_given_sizes():
    devs = [torch.device("cpu", i) for i in range(2)]
    xs, ys = split_batch(torch.arange(5), torch.arange(5), devs, sizes=[1, 4])
    assert [len(x) for x in xs] == [1, 4] and torch.equal(torch.cat(ys), torch.arange(5))
    with pytest.raises(ValueError, match="adding up"):
        split_batch(torch.arange(5), None, devs, sizes=[1, 1])
