"""Collectives built by hand from point-to-point messages, with every byte counted.

Two classic ways to sum a tensor of K bytes held by each of N ranks (an *all-reduce*):

* **Parameter server** (a key-value store with ``push`` and ``pull``). Every worker pushes its value
  of a key to the key's server, which sums them; then every worker pulls the sum. With one server
  (rank 0, which also works) the N-1 other ranks each send K bytes in and receive K bytes back, so
  **2(N-1)K bytes go through the server**: its link carries a load that grows with N. Sharding the
  keys over S servers divides that load: with S = N each rank serves K/N bytes and sends and
  receives 2(N-1)K/N bytes.
* **Ring all-reduce** = reduce-scatter then all-gather. Cut the tensor into N chunks; rank r sends
  to r+1 and receives from r-1. In N-1 reduce-scatter steps each chunk travels round the ring,
  collecting one addend per hop, until rank r holds the full sum of chunk (r+1) mod N; in N-1
  all-gather steps the finished chunks travel round once more. Each rank sends and receives
  **2(N-1)K/N bytes**, whatever N: the bandwidth term stays near 2K as N grows.

The parameter server is built in ``d2lpar.comm.param_server``; this module holds the ring and what both
share (byte counting, chunking). When N does not divide the tensor the chunks differ by one element;
``ring_bytes`` gives the exact counts, and the formula holds exactly when N divides it. The ring's
schedule is data (``ring_schedule``): the same list drives the implementation, the pictures and the
byte counts. Messages are ``isend``/``irecv`` posted together (no send/recv ordering can deadlock),
chunks are views into the caller's tensor (no copies), the all-gather receives straight into place,
and each chunk travels in segments that are forwarded as soon as they arrive (a pipeline).

**All-to-all** is the transpose of the rank x chunk table: rank r cuts its tensor into N chunks and
sends chunk j to rank j, receiving chunk r of every other rank. Nothing is added; each rank sends and
receives **(N-1)K/N bytes**. Expert parallelism (mixture of experts) runs two per layer: tokens go to
the rank that holds their expert, and the expert's outputs come back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from d2lpar.infra.data import chunk_bounds

__all__ = ["ByteCounter", "RingStep", "ring_schedule", "ring_reduce_scatter",
           "ring_all_gather", "ring_all_reduce", "free_workspace", "ring_bytes", "ring_rank_bytes",
           "ring_rank_formula",
           "all_to_all", "all_to_all_bytes", "holdings"]


# ---------------------------------------------------------------------------------- byte counting

@dataclass
class ByteCounter:
    """Bytes and messages one rank sent and received (counted when each message is posted)."""
    sent: int = 0
    received: int = 0
    messages: int = 0

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0):
        self.sent += tensor.numel() * tensor.element_size()
        self.messages += 1
        return dist.isend(tensor, dst, tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0):
        self.received += tensor.numel() * tensor.element_size()
        return dist.irecv(tensor, src, tag=tag)

    def as_dict(self) -> dict[str, int]:
        return {"sent": self.sent, "received": self.received, "messages": self.messages}


def _wait(works) -> None:
    for w in works:
        w.wait()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("the hand-built collectives work in place on a contiguous tensor: "
                         "pass tensor.contiguous() and use the result")
    return tensor.view(-1)


# ------------------------------------------------------------------------------------------ ring

class RingStep(NamedTuple):
    phase: str        # 'reduce-scatter' or 'all-gather'
    step: int         # 0 .. N-2 within the phase
    rank: int         # who acts
    send_chunk: int   # chunk sent to rank+1
    recv_chunk: int   # chunk received from rank-1 (added in reduce-scatter, copied in all-gather)


def ring_schedule(n: int) -> list[RingStep]:
    """Every step of a ring all-reduce on n ranks, for every rank, as data."""
    steps = []
    for s in range(n - 1):
        for r in range(n):
            steps.append(RingStep("reduce-scatter", s, r, (r - s) % n, (r - s - 1) % n))
    for s in range(n - 1):
        for r in range(n):
            steps.append(RingStep("all-gather", s, r, (r + 1 - s) % n, (r - s) % n))
    return steps


_workspace: dict = {}


def _scratch(count: int, numel: int, like: torch.Tensor) -> list[torch.Tensor]:
    """Receive buffers, kept between calls: fresh memory costs page faults on every call.

    ``free_workspace()`` gives the memory back.
    """
    key = (like.dtype, like.device)
    held = _workspace.get(key)
    if held is None or held.numel() < count * numel:
        held = _workspace[key] = torch.empty(count * numel, dtype=like.dtype, device=like.device)
    return [held[i * numel:(i + 1) * numel] for i in range(count)]


def free_workspace() -> None:
    """Release the ring's cached receive buffers."""
    _workspace.clear()


def _ring(flat: torch.Tensor, phases: tuple[str, ...], counter: ByteCounter, segments: int) -> None:
    """Run this rank's steps of ``ring_schedule`` for the given phases, pipelined by segment.

    Each chunk is cut into ``segments`` pieces. A piece is forwarded as soon as it has arrived (and,
    in reduce-scatter, been added), so piece j of step s+1 travels while piece j+1 of step s is
    still on its way: adding overlaps communication and no step waits for a whole chunk. Messages
    carry tag = step * segments + piece, so they can never be matched to the wrong receive.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    bounds = chunk_bounds(flat.numel(), n)
    views = [flat[a:b].tensor_split(segments) for a, b in bounds]  # views: no copies
    steps = [st for st in ring_schedule(n) if st.rank == rank and st.phase in phases]
    # Reduce-scatter receives into two alternating scratch buffers (step i uses buffer i % 2);
    # all-gather receives straight into place.
    # Piece j of every step lands in its own slot of the buffer (slots of the biggest piece): cut
    # by each chunk's own size instead, a chunk one element shorter moves the pieces' boundaries,
    # and the receive posted for step i+2's piece j could overwrite the start of step i's piece
    # j+1 before it has been added.
    slot = -(-max(b - a for a, b in bounds) // segments)
    rs_steps = sum(st.phase == "reduce-scatter" for st in steps)
    scratch = _scratch(min(2, rs_steps), slot * segments, flat)
    recvs, sends = {}, []

    def post_recv(i: int, j: int) -> None:
        st = steps[i]
        target = views[st.recv_chunk][j]
        if target.numel() == 0:
            return
        if st.phase == "reduce-scatter":
            inbox = scratch[i % 2][j * slot:j * slot + target.numel()]
        else:
            inbox = target
        recvs[i, j] = (counter.irecv(inbox, left, tag=i * segments + j), inbox, target)

    def post_send(i: int, j: int) -> None:
        part = views[steps[i].send_chunk][j]
        if part.numel():
            sends.append(counter.isend(part, right, tag=i * segments + j))

    for i, st in enumerate(steps):
        if st.phase == "all-gather" or i < 2:
            for j in range(segments):
                post_recv(i, j)
    for j in range(segments):
        post_send(0, j)
    for i, st in enumerate(steps):
        for j in range(segments):
            if (i, j) in recvs:
                work, inbox, target = recvs.pop((i, j))
                work.wait()
                if st.phase == "reduce-scatter":
                    target.add_(inbox)
            # What step i received (and summed) is exactly what step i+1 sends on.
            if i + 1 < len(steps):
                post_send(i + 1, j)
            if i + 2 < len(steps) and steps[i + 2].phase == "reduce-scatter":
                post_recv(i + 2, j)  # its scratch piece was just consumed
    _wait(sends)


def ring_reduce_scatter(tensor: torch.Tensor, counter: ByteCounter | None = None,
                        segments: int = 1) -> tuple[int, int]:
    """Sum in place so that this rank holds the full sum of chunk (rank+1) mod N; return its bounds."""
    flat = _flat(tensor)
    _ring(flat, ("reduce-scatter",), counter or ByteCounter(), segments)
    n = dist.get_world_size()
    return chunk_bounds(flat.numel(), n)[(dist.get_rank() + 1) % n]


def ring_all_gather(tensor: torch.Tensor, counter: ByteCounter | None = None,
                    segments: int = 1) -> torch.Tensor:
    """Spread each rank's finished chunk (rank+1) mod N to every rank, in place."""
    _ring(_flat(tensor), ("all-gather",), counter or ByteCounter(), segments)
    return tensor


def ring_all_reduce(tensor: torch.Tensor, counter: ByteCounter | None = None,
                    segments: int | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place, by reduce-scatter then all-gather round a ring.

    segments: pieces per chunk message (None: one piece per ~4 MB of chunk, 1 to 8 pieces).
    """
    if dist.get_world_size() == 1:
        return tensor
    counter = counter or ByteCounter()
    if segments is None:
        chunk_bytes = tensor.numel() * tensor.element_size() // dist.get_world_size()
        segments = max(1, min(8, chunk_bytes >> 22))
    _ring(_flat(tensor), ("reduce-scatter", "all-gather"), counter, segments)
    return tensor


# ------------------------------------------------------------------------------------ all-to-all

def all_to_all(output: torch.Tensor, tensor: torch.Tensor,
               counter: ByteCounter | None = None) -> torch.Tensor:
    """This rank's chunk j goes to rank j; rank j's chunk r lands in this rank's ``output`` chunk j.

    The same result as ``dist.all_to_all_single(output, tensor)``, from N-1 ``isend``/``irecv``
    pairs posted at once (own chunk copied locally). The tensor must split into N equal chunks.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    src, dst = _flat(tensor), _flat(output)
    if src.numel() % n or dst.numel() != src.numel():
        raise ValueError(f"all_to_all cuts the tensor into {n} equal chunks: got {src.numel()} "
                         f"elements in and {dst.numel()} out; pad both to a multiple of {n}, "
                         "same size")
    counter = counter or ByteCounter()
    ins, outs = src.chunk(n), dst.chunk(n)
    outs[rank].copy_(ins[rank])
    works = []
    for k in range(1, n):  # step k: send to rank+k, receive from rank-k (every pair once)
        to, frm = (rank + k) % n, (rank - k) % n
        works += [counter.isend(ins[to], to), counter.irecv(outs[frm], frm)]
    _wait(works)
    return output


def all_to_all_bytes(numel: int, n: int, element_size: int = 4) -> list[dict[str, int]]:
    """Bytes each rank sends and receives in ``all_to_all``: (N-1)K/N each way, K = numel * size."""
    if numel % n:
        raise ValueError(f"numel={numel} does not split into {n} equal chunks")
    each = (n - 1) * (numel // n) * element_size
    return [{"sent": each, "received": each} for _ in range(n)]


# ------------------------------------------------------------------------------- bytes, formulas

def ring_bytes(numel: int, n: int, element_size: int = 4) -> list[dict[str, int]]:
    """Exact bytes each rank sends and receives in ``ring_all_reduce`` (any numel)."""
    sizes = [b - a for a, b in chunk_bounds(numel, n)]
    out = [{"sent": 0, "received": 0} for _ in range(n)]
    for st in ring_schedule(n) if n > 1 else []:
        out[st.rank]["sent"] += sizes[st.send_chunk] * element_size
        out[st.rank]["received"] += sizes[st.recv_chunk] * element_size
    return out


RING_PASSES = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


def ring_rank_bytes(kind: str, K: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring collective over a K-byte tensor.

    One pass round the ring moves (N-1)K/N per rank: a reduce-scatter or an all-gather is one pass
    (K: the whole tensor, the reduce-scatter's input or the all-gather's output), an all-reduce two.
    """
    return RING_PASSES[kind] * (n - 1) * K / n


def ring_rank_formula(K: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce: 2(N-1)K/N."""
    return ring_rank_bytes("all_reduce", K, n)


# ---------------------------------------------------------------------------------------- pictures

def holdings(name: str, before: Sequence, after: Sequence, fmt: str = "{:g}") -> str:
    """A text picture of what each rank holds before and after a collective."""
    def show(x):
        if x is None:
            return "-"
        if isinstance(x, (list, tuple)):
            return " ".join(show(v) for v in x)
        t = torch.as_tensor(x).flatten().tolist()
        return "[" + " ".join(fmt.format(v) for v in t) + "]"
    left = [show(b) for b in before]
    width = max(len(s) for s in left + ["before"])
    lines = [f"{name}", f"        {'before':<{width}}    after"]
    for r, (b, a) in enumerate(zip(left, after)):
        lines.append(f"rank {r}  {b:<{width}} -> {show(a)}")
    return "\n".join(lines)
