"""The hand-built ring (and parameter server) equal dist.all_reduce; bytes sent equal the formulas."""

import pytest
import torch
import torch.distributed as dist

from d2lpar import collectives as C
from d2lpar import param_server as PS
from d2lpar.launch import launch

SIZES = [1, 5, 7, 1000, 1003, 4099]  # none of 1000+ divisible by 3; 1 and 5 smaller than some N


def _compare_all(sizes, servers_list):
    """On every rank: run each hand-built all-reduce on random data; return errors and bytes."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for numel in sizes:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + numel))
        expected = x.clone()
        dist.all_reduce(expected)
        row = {"numel": numel}
        counter = C.ByteCounter()
        got = C.ring_all_reduce(x.clone(), counter)
        row["ring"] = ((got - expected).abs().max().item(), counter.sent, counter.received)
        counter = C.ByteCounter()
        got = C.ring_all_reduce(x.clone(), counter, segments=3)
        row["ring3"] = ((got - expected).abs().max().item(), counter.sent, counter.received)
        for s in servers_list:
            counter = C.ByteCounter()
            got = PS.ps_all_reduce(x.clone(), servers=s, counter=counter)
            row[f"ps{s}"] = ((got - expected).abs().max().item(), counter.sent, counter.received)
        out.append(row)
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_hand_built_equal_dist_all_reduce(n):
    servers = sorted({1, 2 if n > 2 else 1, n})
    results = launch(_compare_all, n, SIZES, servers, timeout=60)
    for rank, rows in enumerate(results):
        for row in rows:
            numel = row["numel"]
            err, sent, recv = row["ring"]
            assert err < 1e-5, (n, rank, numel, err)
            exact = C.ring_bytes(numel, n)[rank]
            assert (sent, recv) == (exact["sent"], exact["received"])
            assert row["ring3"][0] < 1e-5 and row["ring3"][1:] == (sent, recv)
            for s in servers:
                err, sent, recv = row[f"ps{s}"]
                assert err < 1e-5, (n, rank, numel, s, err)
                exact = PS.ps_bytes(numel, n, servers=s)[rank]
                assert (sent, recv) == (exact["sent"], exact["received"]), (n, s, rank, numel)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_formulas_hold_exactly_when_n_divides(n):
    numel = 240 * n
    K = numel * 4
    ring = C.ring_bytes(numel, n)
    assert all(r["sent"] == r["received"] == C.ring_rank_formula(K, n) for r in ring)
    ps = PS.ps_bytes(numel, n, servers=1)
    assert ps[0]["sent"] + ps[0]["received"] == PS.ps_server_formula(K, n)
    assert all(r["sent"] == r["received"] == K for r in ps[1:])
    sharded = PS.ps_bytes(numel, n, servers=n)
    assert all(r["sent"] == r["received"] == C.ring_rank_formula(K, n) for r in sharded)


def test_schedule_leaves_each_rank_one_finished_chunk():
    n = 5
    # Track which ranks' addends each rank's copy of each chunk holds.
    held = [[{r} for _ in range(n)] for r in range(n)]
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            steps = [st for st in C.ring_schedule(n) if st.phase == phase and st.step == s]
            sent = {st.rank: set(held[st.rank][st.send_chunk]) for st in steps}
            for st in steps:
                incoming = sent[(st.rank - 1) % n]
                if phase == "reduce-scatter":
                    held[st.rank][st.recv_chunk] |= incoming
                else:
                    held[st.rank][st.recv_chunk] = set(incoming)
        if phase == "reduce-scatter":
            for r in range(n):
                assert held[r][(r + 1) % n] == set(range(n))
    assert all(h == set(range(n)) for row in held for h in row)


def test_helpers_and_errors():
    assert C.chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert C.chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError, match="n >= 1"):
        C.chunk_bounds(4, 0)
    with pytest.raises(ValueError, match="contiguous"):
        C._flat(torch.zeros(3, 4).t())
    text = C.holdings("all_reduce", [torch.tensor([1.0]), torch.tensor([2.0])],
                      [torch.tensor([3.0])] * 2)
    assert "rank 1  [2]" in text and "-> [3]" in text
