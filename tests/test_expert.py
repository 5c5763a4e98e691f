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


def _empty_rank_and_own_seeds(T, d, hidden, E):
    """Each rank seeds its own generator (as torchrun scripts often do) and builds the layer
    without full=; rank 1 has no tokens. Then full= mixtures that differ between ranks."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    moe = ExpertParallelMoE(d, hidden, E, k=1)
    x = torch.randn(T[rank], d, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    out = moe(x)
    aux = moe.last.aux_loss()
    (out.square().sum() + 0.01 * aux).backward()
    try:
        ExpertParallelMoE(d, hidden, E, full=MoE(d, hidden, E, seed=rank))
        differ = None
    except ValueError as e:
        differ = str(e)
    return {"router": moe.router.weight.detach(), "w1": moe.experts.w1.detach(),
            "w2": moe.experts.w2.detach(), "out": out.detach(), "aux": aux.item(),
            "router_grad": moe.router.weight.grad, "differ": differ}


def test_ranks_seeded_apart_share_rank_0s_router_and_an_empty_rank_has_a_finite_aux_loss():
    """Without full=, the router is rank 0's on every rank, so the layer equals one device with
    that router and the ranks' experts; a rank with 0 tokens has an aux loss of 0, not 0/0 = nan.
    One 3-rank launch, about 0.3 s."""
    T, d, hidden, E = [5, 0, 4], 4, 6, 3
    res = launch(_empty_rank_and_own_seeds, 3, T, d, hidden, E, timeout=30)
    assert all(torch.equal(r["router"], res[0]["router"]) for r in res)
    one = MoE(d, hidden, E, k=1)
    with torch.no_grad():
        one.router.weight.copy_(res[0]["router"])
        one.experts.w1.copy_(torch.cat([r["w1"] for r in res]))
        one.experts.w2.copy_(torch.cat([r["w2"] for r in res]))
    for rank, r in enumerate(res):
        x = torch.randn(T[rank], d, generator=torch.Generator().manual_seed(rank))
        torch.testing.assert_close(r["out"], one(x).detach(), rtol=1e-5, atol=1e-6)
        assert r["aux"] == pytest.approx(one.last.aux_loss().item() if T[rank] else 0.0)
        assert torch.isfinite(r["router_grad"]).all()
    assert res[1]["aux"] == 0.0 and res[0]["aux"] > 0
    assert MoE(d, hidden, E)(torch.zeros(0, d)).shape == (0, d)
    assert all(r["differ"] and "the ranks' full= mixtures differ: rank 0's router is not rank"
               in r["differ"] for r in res)


def test_an_infinite_capacity_and_a_batch_of_sequences_are_one_sentence():
    with pytest.raises(ValueError, match=r"capacity_factor=inf: give a finite number above 0"):
        MoE(4, 8, 4, capacity_factor=float("inf"))
    with pytest.raises(ValueError, match=r"the mixture takes tokens as rows \(T, d=4\), got shape "
                                         r"\(2, 3, 4\): flatten them, x.reshape\(-1, 4\)"):
        MoE(4, 8, 4)(torch.randn(2, 3, 4))
