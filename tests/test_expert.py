"""Expert parallelism equals the same mixture on one device (k = 1 and 2, no token dropped), dropped
tokens equal the capacity rule's count, bytes equal the routing's count; bad input is one sentence."""

import math

import pytest
import torch
import torch.distributed as dist

from d2lpar.bench.expert import compare
from d2lpar.processes.launch import RankFailed, launch
from d2lpar.strategies.expert.dispatch import ExpertParallelMoE
from d2lpar.strategies.expert.moe import MoE, capacity, route


@pytest.mark.parametrize("n,E,k", [(2, 6, 1), (3, 6, 2)])
def test_equal_to_one_device_and_bytes_equal_the_routing(n, E, k):
    ratio, diff, res = compare(n, E, k, T=30, d=6, hidden=10)
    assert ratio == 1.0 and diff < 1e-5
    assert sum(r["dropped"] for r in res) == 0


def test_dropped_tokens_follow_the_capacity_rule():
    torch.manual_seed(0)
    logits = torch.randn(40, 4)
    logits[:, 0] += 2.0   # a router that prefers expert 0
    for k, cf in ((1, 1.0), (2, 0.5), (2, 1.25)):
        r = route(logits, k, cf)
        C = capacity(40, k, 4, cf)
        assert C == math.ceil(cf * 40 * k / 4)
        assert r.dropped == int((r.counts - C).clamp(min=0).sum()) > 0
    assert route(logits, 1, None).dropped == 0


def test_the_auxiliary_loss_is_one_when_even_and_more_when_not():
    even = torch.zeros(8, 4)
    even[torch.arange(8), torch.arange(8) % 4] = 5.0
    assert abs(route(even, 1, None).aux_loss().item() - 1.0) < 0.05
    skewed = torch.zeros(8, 4)
    skewed[:, 0] = 5.0
    assert route(skewed, 1, None).aux_loss().item() > 3


def _disagree():
    ExpertParallelMoE(4, 8, 4 + 4 * dist.get_rank())


def test_bad_input_is_one_sentence():
    with pytest.raises(ValueError, match="k=5: a router picks between 1 and E = 4"):
        MoE(4, 8, 4, k=5)
    with pytest.raises(ValueError, match="capacity_factor=0: give a number above 0"):
        MoE(4, 8, 4, capacity_factor=0)
    with pytest.raises(RankFailed, match="the ranks disagree on the mixture: rank 0 has E=4, rank 1 has E=8"):
        launch(_disagree, 2, timeout=30)
