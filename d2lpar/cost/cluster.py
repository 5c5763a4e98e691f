"""A GPU cluster as the planner describes it, and which links each parallel group uses.

A cluster is nodes of ``gpus_per_node`` GPUs joined inside a node by NVLink (NVSwitch) and between
nodes by a network with one card per GPU. Each link is ``costmodel.Link``: a message of b bytes
costs latency + b / bandwidth, and a ring collective over a group pays its slowest link.

**Rank order.** The degrees of a layout are laid out on the ranks innermost first, Megatron-LM's
default being ``tp-cp-dp-pp`` (``megatron/core/parallel_state.py``, ``order``) and Llama 3's
``tp-cp-pp-dp`` (Llama 3 paper, section 3.3.2): rank r's coordinate in the degree at position i is
(r // inner) % degree, inner the product of the degrees before it. A group of k ranks with stride
``inner`` stays inside one node when inner k divides the node's GPUs; otherwise its ring crosses the
network, and the whole collective runs at the network's speed (a tensor degree of 16, or a tensor
degree of 4 placed outside a context degree of 4, on 8-GPU nodes). ``group_links`` says which link
each group of a layout uses; the planner prices every collective on it.

**Compute.** Large matrix products sustain ``utilisation`` of the peak; attention's batched
products, whose inner dimension is a head's width, sustain ``attention_utilisation``
(FlashAttention-2 reaches 50-73 % of an A100's peak, Dao 2023, abstract; 35 % of an H100's, Shah
et al. 2024, FlashAttention-3, section 1).

**Memory.** ``memory_gb`` is the card's memory in GiB (an "80 GB" A100 or H100 holds 80 GiB), of
which ``headroom`` is kept back for what the planner does not count: the CUDA context, NCCL's
buffers, the caching allocator's fragmentation, temporaries (a stated share, not a measured one).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from d2lpar.cost.costmodel import Link

__all__ = ["Cluster", "GIB", "check_cluster", "ORDERS", "check_order", "group_links",
           "usable_bytes"]

GIB = 2 ** 30
ORDERS = ("tp-cp-dp-pp", "tp-cp-pp-dp", "tp-dp-cp-pp", "tp-pp-cp-dp", "cp-tp-dp-pp",
          "tp-dp-pp-cp")


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus: int
    gpus_per_node: int
    memory_gb: float           # GiB per GPU
    peak_flops: float          # dense bf16 peak per GPU
    utilisation: float         # the share of the peak large matrix products sustain
    intra_bandwidth: float     # bytes/s per GPU inside a node (collective bus bandwidth)
    intra_latency: float
    inter_bandwidth: float     # bytes/s per GPU between nodes
    inter_latency: float
    headroom: float = 0.1      # the share of memory kept back
    attention_utilisation: float = 0.0   # the share attention's kernels sustain (0: utilisation)

    @property
    def attention_rate(self) -> float:
        """FLOP/s attention's batched products sustain."""
        return self.peak_flops * (self.attention_utilisation or self.utilisation)

    @functools.cached_property
    def intra(self) -> Link:
        return Link(self.intra_bandwidth, self.intra_latency)

    @functools.cached_property
    def inter(self) -> Link:
        return Link(self.inter_bandwidth, self.inter_latency)


def check_cluster(c: Cluster) -> None:
    """One sentence per impossible cluster."""
    for name in ("gpus", "gpus_per_node"):
        v = getattr(c, name)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"cluster {c.name!r}: {name}={v!r} must be a positive whole number")
    for name in ("memory_gb", "peak_flops", "utilisation", "intra_bandwidth", "intra_latency",
                 "inter_bandwidth", "inter_latency"):
        v = getattr(c, name)
        if v is None or not (v > 0 and math.isfinite(v)):
            raise ValueError(f"cluster {c.name!r}: {name}={v!r} is missing or not a positive "
                             f"number; describe every field (GPUs, memory, FLOP/s, bandwidths, "
                             f"latencies)")
    if c.utilisation > 1:
        raise ValueError(f"cluster {c.name!r}: utilisation={c.utilisation!r} is a share of the "
                         f"peak: give a number in (0, 1]")
    if not 0 <= c.attention_utilisation <= 1:
        raise ValueError(f"cluster {c.name!r}: attention_utilisation={c.attention_utilisation!r} "
                         f"is a share of the peak: give a number in (0, 1], or 0 for utilisation")
    if not 0 <= c.headroom < 1:
        raise ValueError(f"cluster {c.name!r}: headroom={c.headroom!r} is a share of memory: give "
                         f"a number in [0, 1)")
    if c.gpus % c.gpus_per_node and c.gpus > c.gpus_per_node:
        raise ValueError(f"cluster {c.name!r}: {c.gpus} GPUs are not whole nodes of "
                         f"{c.gpus_per_node}")


def usable_bytes(c: Cluster) -> float:
    """Bytes per GPU a layout may use: the card's memory less the headroom."""
    return c.memory_gb * GIB * (1 - c.headroom)


def check_order(order: str) -> list[str]:
    names = order.split("-")
    if sorted(names) != ["cp", "dp", "pp", "tp"]:
        raise ValueError(f"rank order {order!r}: name tp, cp, dp and pp once each, innermost "
                         f"first, e.g. {ORDERS[0]} (Megatron-LM) or {ORDERS[1]} (Llama 3)")
    return names


def group_links(c: Cluster, degrees: dict[str, int], order: str = ORDERS[0]) -> dict[str, Link]:
    """For each of tp, cp, dp and pp, the link its groups' collectives run over: NVLink when the
    group (``degrees[name]`` ranks, stride the product of the degrees inside it) lies in one node,
    else the network."""
    return dict(_links(c, tuple(degrees[k] for k in ("tp", "cp", "dp", "pp")), order))


@functools.lru_cache(maxsize=4096)
def _links(c: Cluster, degrees: tuple[int, int, int, int], order: str) -> tuple:
    node = min(c.gpus_per_node, c.gpus)
    by_name = dict(zip(("tp", "cp", "dp", "pp"), degrees))
    inner, out = 1, []
    for name in check_order(order):
        k = by_name[name]
        out.append((name, c.intra if k == 1 or node % (inner * k) == 0 else c.inter))
        inner *= k
    return tuple(out)
