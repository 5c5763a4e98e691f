"""A parameter server: a synchronous key-value store with ``push`` and ``pull``, over messages.

Every worker **pushes** its value of a key to the key's server, which sums what arrives; then every
worker **pulls** the sum back. That is an all-reduce. With one server (rank 0, which also works) the
N-1 other ranks each send K bytes in and get K back:
**2(N-1)K bytes go through the server**, a load that grows with N. Sharding the keys over S servers
divides it; with S = N each rank sends and receives 2(N-1)K/N bytes, as in a ring, but every pair of
ranks talks. (``nn.DataParallel`` is *not* this server on CUDA builds: it reduces onto GPU 0 with
NCCL's reduce, a chain in which GPU 0 receives K once; the one-server load is its fallback without
NCCL.) ``ps_bytes`` gives the exact counts for any size; ``ps_server_formula`` the formula.
"""

from __future__ import annotations

from typing import Hashable

import torch
import torch.distributed as dist

from d2lpar.comm.collectives import ByteCounter, _flat, _wait
from d2lpar.infra.data import chunk_bounds

__all__ = ["ParameterServer", "ps_all_reduce", "ps_bytes", "ps_server_formula"]


class ParameterServer:
    """A synchronous key-value store over point-to-point messages.

    Ranks 0 .. servers-1 are servers (and also workers); every rank calls ``push`` and ``pull``
    with the same keys. Keys are placed on servers greedily by size, the same on every rank.
    ``push`` sends each value to its key's server, which keeps the sum; ``pull`` copies the sums
    back into every rank's tensors.
    """

    def __init__(self, servers: int = 1, counter: ByteCounter | None = None):
        n = dist.get_world_size()
        if not 1 <= servers <= n:
            raise ValueError(f"servers={servers} but there are {n} ranks: use 1 (one server) up "
                             f"to {n} (keys sharded over every rank)")
        self.servers, self.counter = servers, counter or ByteCounter()
        self.store: dict[Hashable, torch.Tensor] = {}

    def placement(self, values: dict[Hashable, torch.Tensor]) -> dict[Hashable, int]:
        """Server rank of each key: the biggest keys first, each to the least loaded server."""
        load = [0] * self.servers
        where = {}
        for key in sorted(values, key=lambda k: (-values[k].numel(), list(values).index(k))):
            s = min(range(self.servers), key=lambda i: (load[i], i))
            where[key] = s
            load[s] += values[key].numel()
        return where

    def push(self, values: dict[Hashable, torch.Tensor]) -> None:
        rank, n = dist.get_rank(), dist.get_world_size()
        where = self.placement(values)
        works, inboxes = [], []
        for key, value in values.items():
            server = where[key]
            if rank != server:
                works.append(self.counter.isend(_flat(value), server))
                continue
            boxes = [torch.empty_like(_flat(value)) for _ in range(n - 1)]
            peers = [p for p in range(n) if p != rank]
            works += [self.counter.irecv(b, p) for b, p in zip(boxes, peers)]
            inboxes.append((key, value, boxes))
        _wait(works)
        for key, value, boxes in inboxes:
            total = _flat(value).clone()
            for b in boxes:
                total.add_(b)
            self.store[key] = total

    def pull(self, out: dict[Hashable, torch.Tensor]) -> None:
        rank, n = dist.get_rank(), dist.get_world_size()
        where = self.placement(out)
        works = []
        for key, tensor in out.items():
            if rank == where[key]:
                works += [self.counter.isend(self.store[key], p) for p in range(n) if p != rank]
                _flat(tensor).copy_(self.store[key])
            else:
                works.append(self.counter.irecv(_flat(tensor), where[key]))
        _wait(works)


def ps_all_reduce(tensor: torch.Tensor, servers: int = 1,
                  counter: ByteCounter | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place through a parameter server with ``servers`` shards."""
    if dist.get_world_size() == 1:
        return tensor
    flat = _flat(tensor)
    shards = {i: flat[a:b] for i, (a, b) in enumerate(chunk_bounds(flat.numel(), servers)) if b > a}
    ps = ParameterServer(servers, counter)
    ps.push(shards)
    ps.pull(shards)
    return tensor


def ps_bytes(numel: int, n: int, element_size: int = 4, servers: int = 1) -> list[dict[str, int]]:
    """Exact bytes each rank sends and receives in ``ps_all_reduce`` (any numel)."""
    out = [{"sent": 0, "received": 0} for _ in range(n)]
    for s, (a, b) in enumerate(chunk_bounds(numel, servers)):
        k = (b - a) * element_size
        for r in range(n):
            if r != s:
                out[r]["sent"] += k        # push
                out[r]["received"] += k    # pull
                out[s]["received"] += k
                out[s]["sent"] += k
    return out


def ps_server_formula(K: float, n: int) -> float:
    """Bytes through the one server of a parameter server: 2(N-1)K."""
    return 2 * (n - 1) * K
