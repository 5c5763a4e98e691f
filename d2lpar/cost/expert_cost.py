"""What splitting the experts costs: the all-to-all's bytes and time for a mixture-of-experts layer.

T tokens per rank, each sent to k experts of width d, with E experts spread evenly over N ranks: an
even router sends T k (N-1)/N assignments off each rank, d elements each, to dispatch, and as many
results come back to combine. From a routing, a rank's bytes are exact:

    dispatch sent = sum over other ranks p of (its assignments to p's experts) * d * e
    combine sent  = sum over other ranks p of (p's assignments to my experts)  * d * e

**Time**: the dispatch and the combine are two all-to-alls; inside a node they ride NVLink, across
nodes the network, which is 10 times slower or more: an MoE layer's all-to-all is why expert
parallelism is kept inside a node when it can be.
"""

from __future__ import annotations

from d2lpar.cost.costmodel import Gpu, Link

__all__ = ["even_bytes", "routed_bytes", "moe_flops", "all_to_all_time", "moe_layer_time"]


def even_bytes(T: int, k: int, d: int, n: int, element: int = 4) -> float:
    """Bytes one rank sends to dispatch (and again to combine) with an even router."""
    return T * k * (n - 1) / n * d * element


def routed_bytes(counts_by_rank, rank: int, experts_per_rank: int, d: int,
                 element: int = 4) -> tuple[int, int]:
    """(dispatch, combine) bytes ``rank`` sends, from each rank's kept assignments per expert."""
    n = len(counts_by_rank)
    to_rank = [[sum(c[p * experts_per_rank:(p + 1) * experts_per_rank]) for p in range(n)]
               for c in counts_by_rank]
    dispatch = sum(to_rank[rank][p] for p in range(n) if p != rank)
    combine = sum(to_rank[p][rank] for p in range(n) if p != rank)
    return dispatch * d * element, combine * d * element


def moe_flops(T: int, k: int, d: int, hidden: int, matrices: int = 2) -> float:
    """Forward FLOPs of the experts for T tokens, k experts each: ``matrices`` products of 2 d
    hidden FLOPs per token (2: up and down; 3: a SwiGLU expert's gate, up and down, as
    Mixtral's)."""
    return T * k * matrices * 2 * d * hidden


def all_to_all_time(nbytes_per_rank: float, n: int, link: Link) -> float:
    """Each rank sends its bytes in N-1 pieces, one after the other, over its link."""
    return (n - 1) * link.time(nbytes_per_rank / max(n - 1, 1))


def moe_layer_time(T: int, k: int, d: int, hidden: int, n: int, gpu: Gpu, link: Link,
                   element: int = 2, matrices: int = 2) -> dict[str, float]:
    """Compute and the two all-to-alls of one MoE layer's forward, per rank, in seconds (the
    backward is not counted: twice the forward's compute, and both all-to-alls again)."""
    a2a = all_to_all_time(even_bytes(T, k, d, n, element), n, link)
    flops = moe_flops(T, k, d, hidden, matrices)
    return {"compute": gpu.time(flops, 2), "dispatch": a2a, "combine": a2a}
