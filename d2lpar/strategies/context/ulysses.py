"""DeepSpeed-Ulysses: an all-to-all turns a sequence split into a head split, and back.

Each of N ranks holds S/N tokens of q, k and v for all a heads. Attention is independent per head,
so one all-to-all per tensor regroups them: rank r sends rank p the heads p a/N .. (p+1) a/N - 1 of
its tokens and receives its own heads for every token; now each rank holds the whole sequence for
a/N heads and runs ordinary attention on it (``scaled_dot_product_attention``, causal or not, no
change at all). A fourth all-to-all sends the outputs back to a sequence split. Each all-to-all
moves (N-1)/N of a rank's b (S/N) d elements, so a rank sends 4 (N-1)/N * b S d / N elements per
layer forward, a fraction 1/N of ring attention's (N-1) * 2 b S d / N: Ulysses' traffic per rank
falls as N grows, the ring's does not. The catch: the heads must divide over the ranks (a % N == 0),
so N is at most a (and with grouped-query attention, at most the number of key/value heads without
copies: those must divide over the ranks too; rank p then holds query heads p a/N .. and the
key/value heads of their groups, and attention runs with ``enable_gqa``).

``AllToAll`` is differentiable: its backward is the all-to-all that undoes it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["AllToAll", "seq_to_heads", "heads_to_seq", "ulysses_attention"]


class AllToAll(torch.autograd.Function):
    """Scatter ``x`` along ``scatter_dim`` to the ranks and gather their pieces along
    ``gather_dim``."""

    @staticmethod
    def forward(ctx, x, scatter_dim: int, gather_dim: int, counter):
        ctx.dims, ctx.counter = (scatter_dim, gather_dim), counter
        return _all_to_all(x, scatter_dim, gather_dim, counter)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.counter), None, None, None


def _all_to_all(x, scatter_dim, gather_dim, counter):
    n = dist.get_world_size()
    pieces = [p.contiguous() for p in x.chunk(n, scatter_dim)]
    out = [torch.empty_like(pieces[0]) for _ in range(n)]
    dist.all_to_all(out, pieces)
    if counter is not None:   # what leaves this rank: every piece but its own, counted one by one
        mine = dist.get_rank()
        sent = [p.numel() * p.element_size() for i, p in enumerate(pieces) if i != mine]
        counter["sent"] = counter.get("sent", 0) + sum(sent)
        counter["messages"] = counter.get("messages", 0) + len(sent)
    return torch.cat(out, gather_dim)


def seq_to_heads(x, counter=None):
    """(b, a, S/N, d_h) on each rank -> (b, a/N, S, d_h): scatter heads, gather the sequence."""
    return AllToAll.apply(x, 1, 2, counter)


def heads_to_seq(x, counter=None):
    """(b, a/N, S, d_h) -> (b, a, S/N, d_h)."""
    return AllToAll.apply(x, 2, 1, counter)


def ulysses_attention(q, k, v, causal: bool = False, counter: dict | None = None):
    """This rank's attention output for its S/N tokens (b, a, S/N, d_h), all heads."""
    n, heads, kv = dist.get_world_size(), q.shape[1], k.shape[1]
    if v.shape[1] != kv:
        raise ValueError(f"k has {kv} heads and v {v.shape[1]}: give k and v the same heads")
    if heads % kv:
        raise ValueError(f"q has {heads} heads and k/v {kv}: grouped-query attention needs the "
                         f"query heads to be a multiple of the key/value heads")
    if heads % n:
        raise ValueError(f"Ulysses splits the {heads} heads over {n} ranks: the heads must divide "
                         f"evenly; use a number of ranks that divides {heads} (or ring attention)")
    if kv % n:
        raise ValueError(f"Ulysses splits the {kv} key/value heads over {n} ranks: they must "
                         f"divide evenly; use a number of ranks that divides {kv} (or repeat the "
                         f"key/value heads, or ring attention)")
    q, k, v = (seq_to_heads(t, counter) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv != heads)
    return heads_to_seq(out, counter)
