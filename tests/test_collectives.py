"""The hand-built ring (and parameter server) give the sum computed in the caller; bytes equal the formulas."""

import pytest
import torch
import torch.distributed as dist

from d2lpar.comm import collectives as C
from d2lpar.comm import param_server as PS
from d2lpar.infra.data import chunk_bounds
from d2lpar.processes.launch import launch

SIZES = [1, 5, 7, 1000, 1003, 4099]  # none of 1000+ divisible by 3; 1 and 5 smaller than some N


def _data(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + numel))


def _run_all(sizes, servers_list):
    """On every rank: run each hand-built all-reduce on this rank's data; return results and bytes."""
    rank = dist.get_rank()
    out = []
    for numel in sizes:
        x = _data(rank, numel)
        row = {"numel": numel}
        for name, run in [("ring", lambda t, c: C.ring_all_reduce(t, c)),
                          ("ring3", lambda t, c: C.ring_all_reduce(t, c, segments=3))] + \
                [(f"ps{s}", lambda t, c, s=s: PS.ps_all_reduce(t, servers=s, counter=c))
                 for s in servers_list]:
            counter = C.ByteCounter()
            row[name] = (run(x.clone(), counter), counter.sent, counter.received)
        out.append(row)
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_hand_built_all_reduce_equals_the_sum_computed_here(n):
    servers = sorted({1, 2 if n > 2 else 1, n})
    results = launch(_run_all, n, SIZES, servers, timeout=60)
    for numel in SIZES:
        inputs = [_data(r, numel) for r in range(n)]
        total = torch.stack(inputs).sum(0)  # the sum, computed in this process
        for rank, rows in enumerate(results):
            row = next(r for r in rows if r["numel"] == numel)
            assert not torch.allclose(inputs[rank], total)  # differ before ...
            for name in ["ring", "ring3"] + [f"ps{s}" for s in servers]:
                got, sent, recv = row[name]
                torch.testing.assert_close(got, total, msg=f"{name}, n={n}, rank {rank}, numel {numel}")
                exact = (C.ring_bytes(numel, n) if name.startswith("ring")
                         else PS.ps_bytes(numel, n, servers=int(name[2:])))[rank]
                assert (sent, recv) == (exact["sent"], exact["received"]), (name, n, rank, numel)


def _reduce_scatter_then_gather(numel):
    rank = dist.get_rank()
    x = _data(rank, numel)
    counter = C.ByteCounter()
    start, stop = C.ring_reduce_scatter(x, counter)
    mine = x[start:stop].clone()
    held = len(C._workspace)  # the ring keeps its receive buffers between calls ...
    C.free_workspace()        # ... until told to give them back
    freed = len(C._workspace)
    C.ring_all_gather(x, counter)
    return {"bounds": (start, stop), "mine": mine, "gathered": x, "sent": counter.sent,
            "held": held, "freed": freed}


@pytest.mark.parametrize("n,numel", [(2, 10), (3, 7), (4, 1003)])
def test_reduce_scatter_then_all_gather(n, numel):
    results = launch(_reduce_scatter_then_gather, n, numel, timeout=60)
    total = torch.stack([_data(r, numel) for r in range(n)]).sum(0)
    chunks = chunk_bounds(numel, n)
    for rank, out in enumerate(results):
        a, b = out["bounds"]
        assert (a, b) == chunks[(rank + 1) % n], "rank r finishes chunk (r+1) mod n"
        torch.testing.assert_close(out["mine"], total[a:b])
        torch.testing.assert_close(out["gathered"], total)
        assert out["sent"] == C.ring_bytes(numel, n)[rank]["sent"]
        assert out["held"] == 1 and out["freed"] == 0


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
    with pytest.raises(ValueError, match="contiguous"):
        C._flat(torch.zeros(3, 4).t())
    text = C.holdings("all_reduce", [torch.tensor([1.0]), torch.tensor([2.0])],
                      [torch.tensor([3.0])] * 2)
    assert "rank 1  [2]" in text and "-> [3]" in text


def _all_to_all(numel):
    rank = dist.get_rank()
    x, counter = _data(rank, numel), C.ByteCounter()
    out = C.all_to_all(torch.zeros(numel), x, counter)
    lib = torch.zeros(numel)
    dist.all_to_all_single(lib, x)
    return out, lib, counter.as_dict()


def test_all_to_all_is_the_transpose_computed_here():
    n, numel = 3, 12
    results = launch(_all_to_all, n, numel, timeout=60)
    chunks = [_data(r, numel).chunk(n) for r in range(n)]  # chunks[r][j]: rank r's chunk for rank j
    for rank, (out, lib, count) in enumerate(results):
        expected = torch.cat([chunks[j][rank] for j in range(n)])
        assert not torch.equal(_data(rank, numel), expected)  # differ before ...
        torch.testing.assert_close(out, expected, rtol=0, atol=0)  # ... equal after
        torch.testing.assert_close(lib, expected, rtol=0, atol=0)
        exact = C.all_to_all_bytes(numel, n)[rank]
        assert (count["sent"], count["received"]) == (exact["sent"], exact["received"]) == (32, 32)
    with pytest.raises(ValueError, match="equal chunks"):
        C.all_to_all_bytes(10, 3)
