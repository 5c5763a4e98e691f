"""Ring attention: queries stay on their rank, key/value blocks travel around the ring.

The sequence of S tokens is cut into chunks; each of N ranks holds the queries, keys and values of
its own chunks. Attention needs every query against every key, so the key/value blocks go round the
ring: at step t rank r holds the block that started on rank r - t, computes its queries against it,
and passes it on (``isend`` to r + 1, ``irecv`` from r - 1), the send of the next block posted
*before* the current block's computation, so that the two overlap.

**Online softmax.** The blocks arrive one at a time, so softmax(q K^T) V is built without the whole
row: for each block, with scores z = q k^T / sqrt(d_h) (masked entries -inf),

    m_b = max z,   l_b = sum exp(z - m_b),   o_b = exp(z - m_b) v
    m = max(m_old, m_b),   l = l_old e^(m_old - m) + l_b e^(m_b - m),
    o = o_old e^(m_old - m) + o_b e^(m_b - m)

and the output is o / l: the same as one softmax over the whole row. **Backward** is autograd
through these operations and through ``RingShift``, a send/receive whose backward sends the gradient
the other way round the ring, so each block's key/value gradient returns to the rank that owns it.
Two costs of that simplicity: autograd keeps every key/value block a rank received (the whole
sequence's K and V, on every rank) and each block's scores; and the backward's transfers are waited
for at once, so they do not overlap compute. A production ring (torch's
``_templated_ring_attention_backward``, Liu et al.'s Ring Attention) keeps only its own block and
the log-sum-exp, sends K/V round the ring again in the backward with a second ring for dK/dV, and
recomputes each block's scores, as flash attention does.

**Causal masks and the zig-zag split.** With a causal mask a query attends to keys at or before it.
Cut in N contiguous chunks, rank r's queries see r + 1 of the N chunks, the last of them a triangle:
r + 1/2 blocks of work, so the last rank does 2N - 1 times the first one's work. Cut in 2N chunks,
rank r holding chunks r and 2N - 1 - r, every rank does the same work. A (query chunk i, key chunk
j) pair is full when j < i, triangular when j = i, skipped when j > i.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

__all__ = ["chunk_ids", "split_sequence", "merge_sequence", "RingShift", "block_attention",
           "merge", "ring_attention", "work_per_rank", "reference_attention"]


def chunk_ids(n: int, zigzag: bool) -> list[list[int]]:
    """Which chunks of the sequence each of n ranks holds: [r] (n chunks) or [r, 2n-1-r] (2n
    chunks)."""
    return [[r, 2 * n - 1 - r] if zigzag else [r] for r in range(n)]


def split_sequence(x: torch.Tensor, n: int, zigzag: bool, dim: int = 2) -> list[torch.Tensor]:
    """Each rank's part of x along ``dim`` (its chunks, concatenated in order)."""
    pieces = 2 * n if zigzag else n
    if x.shape[dim] % pieces:
        raise ValueError(f"a sequence of {x.shape[dim]} tokens does not cut into {pieces} equal "
                         "chunks "
                         f"({'2N for the zig-zag split' if zigzag else 'N'}, N = {n} ranks): use a "
                         f"length that is a multiple of {pieces}")
    chunks = x.chunk(pieces, dim)
    return [torch.cat([chunks[i] for i in ids], dim) for ids in chunk_ids(n, zigzag)]


def merge_sequence(parts: list[torch.Tensor], zigzag: bool, dim: int = 2) -> torch.Tensor:
    """The inverse of ``split_sequence``."""
    n = len(parts)
    chunks: dict[int, torch.Tensor] = {}
    for ids, part in zip(chunk_ids(n, zigzag), parts):
        for i, piece in zip(ids, part.chunk(len(ids), dim)):
            chunks[i] = piece
    return torch.cat([chunks[i] for i in sorted(chunks)], dim)


class RingShift(torch.autograd.Function):
    """Send ``x`` to rank r+1 and receive rank r-1's; backward sends the gradient to r-1."""

    @staticmethod
    def forward(ctx, x, counter):
        ctx.counter = counter
        return _shift(x, +1, counter)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad.contiguous(), -1, ctx.counter), None


PENDING: list = []


def _shift(x: torch.Tensor, direction: int, counter: dict | None) -> torch.Tensor:
    """Post the send and the receive and return the receive buffer; ``wait()`` before reading it."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.empty_like(x)
    works = [dist.isend(x.contiguous(), (rank + direction) % n),
             dist.irecv(out, (rank - direction) % n)]
    if counter is not None:
        counter["sent"] = counter.get("sent", 0) + x.numel() * x.element_size()
        counter["messages"] = counter.get("messages", 0) + 1
    PENDING.append(works)
    if direction < 0:   # backward: autograd reads the result at once
        wait()
    return out


def wait() -> None:
    """Wait for every send and receive posted so far."""
    while PENDING:
        for w in PENDING.pop():
            w.wait()


def block_attention(q, k, v, kind: str):
    """(o_b, m_b, l_b) of queries q against one key/value block; kind 'full' or 'causal'
    (diagonal)."""
    z = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if kind == "causal":
        z = z.masked_fill(torch.ones(z.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    m = z.amax(-1, keepdim=True)
    p = torch.exp(z - m)
    return p @ v, m, p.sum(-1, keepdim=True)


def merge(state, block):
    """The online-softmax merge of a running (o, m, l) with a block's (o_b, m_b, l_b)."""
    if state is None:
        return block
    (o, m, l), (ob, mb, lb) = state, block
    new = torch.maximum(m, mb)
    a, b = torch.exp(m - new), torch.exp(mb - new)
    return o * a + ob * b, new, l * a + lb * b


def _kind(i: int, j: int, causal: bool) -> str | None:
    if not causal or j < i:
        return "full"
    return "causal" if j == i else None


def ring_attention(q, k, v, causal: bool = False, zigzag: bool = False, counter: dict | None = None,
                   device_wait: float = 0.0, spans: list | None = None, blocks: list | None = None):
    """This rank's attention output for its queries q (b, heads, s_local, d_h) over the whole
    sequence.

    q, k, v hold this rank's chunks (``split_sequence``); ``counter`` counts the bytes sent;
    ``device_wait`` makes each block's computation last at least that long (a stand-in for a GPU,
    messages stay real); ``spans`` receives (lane, label, start, end) for a timeline; ``blocks``
    receives each stacked key/value block this rank computes on (its own first), to see which of
    them autograd keeps.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    ids = chunk_ids(n, zigzag)
    per = len(ids[rank])
    qs = q.chunk(per, 2)
    kv = torch.stack([k, v])
    states = [None] * per
    anchor = 0.0
    for step in range(n):
        owner = (rank - step) % n
        t0 = time.perf_counter()
        nxt = RingShift.apply(kv, counter) if step < n - 1 else None   # posted before computing
        t1 = time.perf_counter()
        if blocks is not None:
            blocks.append(kv)
        ks, vs = kv[0].chunk(per, 2), kv[1].chunk(per, 2)
        for a, i in enumerate(ids[rank]):
            for c, j in enumerate(ids[owner]):
                kind = _kind(i, j, causal)
                if kind is not None:
                    states[a] = merge(states[a], block_attention(qs[a], ks[c], vs[c], kind))
        if device_wait:
            time.sleep(max(0.0, device_wait - (time.perf_counter() - t1)))
        t2 = time.perf_counter()
        if nxt is not None:
            wait()
            kv = nxt
            if kv.requires_grad:
                anchor = anchor + 0.0 * kv.sum()
        t3 = time.perf_counter()
        if spans is not None:
            spans.append((f"rank {rank}", f"block {owner}", t1, t2))
            if step < n - 1:
                spans.append((f"rank {rank} comm", f"send {owner}", t0, max(t2, t3)))
    # Every shift's backward must run on every rank: it also *receives* the gradient of the block
    # this rank sent. A block no query here attends to (a causal mask) would leave it out of the
    # graph, and the neighbour would wait for ever: a zero-weight term keeps each received block in
    # the graph.
    return torch.cat([o / l for o, m, l in states], 2) + anchor


def work_per_rank(n: int, causal: bool, zigzag: bool) -> list[float]:
    """Query-key pairs each rank computes, in units of one (chunk x chunk) block; a triangle is
    1/2."""
    ids = chunk_ids(n, zigzag)
    every = [j for r in range(n) for j in ids[r]]
    weight = {"full": 1.0, "causal": 0.5, None: 0.0}
    return [sum(weight[_kind(i, j, causal)] for i in ids[r] for j in every)
            for r in range(n)]


def reference_attention(q, k, v, causal: bool = False):
    """One device: ``scaled_dot_product_attention`` on the whole sequence."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
