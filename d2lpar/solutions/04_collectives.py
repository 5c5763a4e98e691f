"""Worked solutions to the exercises of notebook 04 (collectives by hand).

Each ``exercise_k`` computes its answer, prints it, and asserts what the answer claims.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from d2lpar.infra.verdict import busy_clause
from d2lpar.bench import allreduce as bench
from d2lpar.comm import collectives as C
from d2lpar.comm import param_server as PS
from d2lpar.cost import costmodel as cm
from d2lpar.processes.launch import launch


def _data(rank, numel):
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + numel))


def _counts(numel, segments):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, fn in [("ring", lambda t, c: C.ring_all_reduce(t, c, segments=segments)),
                     ("ps, 1 server", lambda t, c: PS.ps_all_reduce(t, 1, c))]:
        counter = C.ByteCounter()
        out[name] = (fn(_data(rank, numel), counter), counter.as_dict())
    return out


def exercise_1():
    """Messages per rank: the ring 2(N-1) per segment of a chunk, on every rank; through one server,
    N-1 on the server (one pull reply per worker; it receives N-1 pushes) and 1 on every worker."""
    for n in (2, 4):
        for segments in (1, 3):
            ranks = launch(_counts, n, 1200, segments, quiet=True)
            ring = [r["ring"][1]["messages"] for r in ranks]
            ps = [r["ps, 1 server"][1]["messages"] for r in ranks]
            print(f"N={n}, {segments} segment(s): ring {ring}, one server {ps}")
            assert ring == [2 * (n - 1) * segments] * n
            assert ps == [n - 1] + [1] * (n - 1)


def exercise_2():
    """segments=4 cuts every chunk message into 4: four times the messages, the same bytes (every
    element still crosses each link the same number of times), the same sum."""
    n, numel = 3, 1001
    one, four = launch(_counts, n, numel, 1, quiet=True), launch(_counts, n, numel, 4, quiet=True)
    total = torch.stack([_data(r, numel) for r in range(n)]).sum(0)
    for rank in range(n):
        (t1, c1), (t4, c4) = one[rank]["ring"], four[rank]["ring"]
        torch.testing.assert_close(t4, total)
        assert (c4["sent"], c4["received"]) == (c1["sent"], c1["received"]) == \
            (C.ring_bytes(numel, n)[rank]["sent"], C.ring_bytes(numel, n)[rank]["received"])
        assert c4["messages"] == 4 * c1["messages"]
    print(f"N={n}: bytes per rank {[four[r]['ring'][1]['sent'] for r in range(n)]} with 1 or 4 segments; "
          f"messages {one[0]['ring'][1]['messages']} -> {four[0]['ring'][1]['messages']}")


def exercise_3():
    """There is none: both take 2(N-1) rounds, so their latency terms are equal, and the server's
    bandwidth and adding terms are N times the ring's. What would change it: a server that receives
    from all workers at once (one round in, one out: latency 2 alpha), which then wins for small K."""
    m, n = cm.MACHINES["8 GPUs, PCIe 4.0"], 8
    sizes = [2 ** k for k in range(0, 31)]
    wins = [s for s in sizes if cm.allreduce_time("one_device", s, n, m) < cm.allreduce_time("ring", s, n, m)]
    print(f"sizes from 1 B to 1 GB where one server beats the ring on {m.name}, N={n}: {wins or 'none'}")
    assert not wins
    alpha, beta, add = m.device_link.latency, m.device_link.bandwidth, m.reduce_bandwidth

    def concurrent_server(K):  # everything still crosses the server's link, but in 2 rounds, not 2(N-1)
        return 2 * alpha + 2 * (n - 1) * K / beta + (n - 1) * K / add
    below = max(s for s in sizes if concurrent_server(s) < cm.allreduce_time("ring", s, n, m))
    print(f"a server receiving from all {n - 1} workers at once would win below about {below / 1024:.0f} KB")
    assert concurrent_server(below) < cm.allreduce_time("ring", below, n, m)
    assert concurrent_server(2 * below) >= cm.allreduce_time("ring", 2 * below, n, m)


def tree_all_reduce(t, counter):
    """Reduce up a binary tree rooted at rank 0 (children 2r+1, 2r+2), then broadcast down."""
    rank, n = dist.get_rank(), dist.get_world_size()
    parent, children = (rank - 1) // 2, [c for c in (2 * rank + 1, 2 * rank + 2) if c < n]
    inbox = [torch.empty_like(t) for _ in children]
    for w in [counter.irecv(b, c) for b, c in zip(inbox, children)]:
        w.wait()
    for b in inbox:
        t += b
    if rank > 0:
        counter.isend(t, parent).wait()
        counter.irecv(t, parent).wait()
    for w in [counter.isend(t, c) for c in children]:
        w.wait()
    return t


def _tree(numel):
    rank = dist.get_rank()
    counter = C.ByteCounter()
    return tree_all_reduce(_data(rank, numel), counter), counter.as_dict()


def exercise_4():
    """A binary tree takes 2 floor(log2 N) steps instead of the ring's 2(N-1), but a node sends up to
    2K (two children) on each step where the ring sends K/N: it wins when latency dominates (small
    messages, many ranks) and loses when bandwidth does."""
    for n in (4, 5):
        numel = 1000
        ranks = launch(_tree, n, numel, quiet=True)
        total = torch.stack([_data(r, numel) for r in range(n)]).sum(0)
        K = 4 * numel
        for r, (got, count) in enumerate(ranks):
            assert not torch.allclose(_data(r, numel), total)   # differ before ...
            torch.testing.assert_close(got, total)              # ... equal after
            kids = sum(c < n for c in (2 * r + 1, 2 * r + 2))
            assert count["sent"] == K * (kids + (r > 0)) and count["received"] == K * (kids + (r > 0))
        print(f"N={n}: tree == the sum computed here; bytes sent per rank "
              f"{[c['sent'] for _, c in ranks]} (K = {K}); steps {2 * int(math.log2(n))}, ring {2 * (n - 1)}")
    m, n = cm.MACHINES["8 GPUs, PCIe 4.0"], 64
    alpha, beta = m.device_link.latency, m.device_link.bandwidth

    def tree_time(K):
        return 2 * int(math.log2(n)) * (alpha + 2 * K / beta)
    small, big = 1024, 100 * 2 ** 20
    print(f"cost model, N={n}, {m.name} links: 1 KB tree {tree_time(small) * 1e6:.0f} us vs ring "
          f"{cm.allreduce_time('ring', small, n, m) * 1e6:.0f} us; 100 MB tree {tree_time(big) * 1e3:.0f} ms "
          f"vs ring {cm.allreduce_time('ring', big, n, m) * 1e3:.0f} ms")
    assert tree_time(small) < cm.allreduce_time("ring", small, n, m)
    assert tree_time(big) > cm.allreduce_time("ring", big, n, m)


def exercise_5():
    """The bench's ring bus bandwidth beside the one the fitted model predicts for the same ring.
    (A short version of `python -m d2lpar bench allreduce --quick`: N = 2, 1 MB and 16 MB.)"""
    link = cm.fit_link(*cm.measure_pingpong(sizes=(64 << 10, 1 << 20, 4 << 20), repeats=3))
    here = cm.this_machine(link, cm.measure_reduce_bandwidth())
    rows = bench.run([2], [1 << 20, 16 << 20], methods=("all_reduce", "ring"), rounds=3, round_s=0.01)
    for n, nbytes, t in rows:
        busbw = {k: nbytes / v * 2 * (n - 1) / n / 1e9 for k, v in t.items()}
        predicted = nbytes / cm.allreduce_time("ring", nbytes, n, here) * 2 * (n - 1) / n / 1e9
        print(f"N={n} {nbytes >> 20:>2} MB: busbw all_reduce {busbw['all_reduce']:.2f}, ring {busbw['ring']:.2f}, "
              f"predicted ring {predicted:.2f} GB/s")
        if busy_clause():  # the fit and the bench ran at different moments of a busy machine
            print("  not compared:" + busy_clause().strip("\n"))
        else:
            assert 0.1 < busbw["ring"] / predicted < 10, "the fitted model is off by more than 10x"
