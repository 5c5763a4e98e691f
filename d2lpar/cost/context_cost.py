"""What splitting the sequence costs: bytes per rank and time per attention layer, ring against
Ulysses.

For b sequences of S tokens of width d (elements of e bytes) on N ranks, per attention layer forward
(the backward sends as much again):

    ring attention   (N-1) * 2 b (S/N) d e        each rank passes N-1 key/value blocks on
    Ulysses          4 (N-1)/N * b (S/N) d e      four all-to-alls (q, k, v in; the output back)

The ring's traffic per rank does not shrink with N; Ulysses' does, by 1/N. Each rank holds the
activations of S/N tokens in both (1/N of one device's), and computes 1/N of the attention's
4 b S^2 d FLOPs (half of it with a causal mask, when the work is balanced: the zig-zag split).

**Time.** The ring overlaps the transfer of the next block with the current block's compute: N steps
of max(compute of a (S/N) x (S/N) block, transfer of one block). Ulysses computes its heads without
communication, but its all-to-alls cannot overlap the attention that needs their result.
"""

from __future__ import annotations

from d2lpar.cost.costmodel import Gpu, Link

__all__ = ["ring_bytes", "ulysses_bytes", "attention_flops", "ring_time", "ulysses_time"]


def ring_bytes(b: int, S: int, d: int, n: int, element: int = 4) -> float:
    return (n - 1) * 2 * b * (S / n) * d * element


def ulysses_bytes(b: int, S: int, d: int, n: int, element: int = 4) -> float:
    return 4 * (n - 1) / n * b * (S / n) * d * element


def attention_flops(b: int, S: int, d: int, causal: bool = False) -> float:
    """q k^T and the weighted sum of v: 2 * 2 b S^2 d (half with a causal mask)."""
    return 4 * b * S * S * d / (2 if causal else 1)


def ring_time(b: int, S: int, d: int, n: int, gpu: Gpu, link: Link, element: int = 2) -> float:
    block = gpu.time(4 * b * (S / n) ** 2 * d, 2)
    send = link.time(2 * b * (S / n) * d * element)
    return block + (n - 1) * max(block, send)


def ulysses_time(b: int, S: int, d: int, n: int, gpu: Gpu, link: Link, element: int = 2) -> float:
    piece = b * (S / n) * d / n * element
    all_to_all = (n - 1) * link.time(piece)
    return gpu.time(attention_flops(b, S, d) / n, 2) + 4 * all_to_all
