"""Expert parallelism: E experts over N ranks, tokens sent to their expert's rank and back.

Each rank holds its own tokens (data parallelism over tokens), the same router, and E/N experts:
rank p holds experts p E/N .. (p+1) E/N - 1. One forward pass:

1. **route** locally (``moe.route``: top-k, capacity per rank, as GShard's groups);
2. **sort** the kept assignments by expert, so that each destination rank's tokens are contiguous;
3. **exchange counts** (``all_to_all_single`` of the per-expert counts): a rank cannot
   receive tokens before it knows how many will come from each rank, for each of its experts;
4. **dispatch** the tokens (``all_to_all_single`` with those split sizes);
5. run each local expert on the tokens it received;
6. **combine**: the reverse all-to-all sends each result home, where it is weighted by the router's
   probability and added at its token's place, in the original order.

Bytes a rank sends: d * element_size per assignment routed to another rank, once to dispatch and
once more (the results) to combine; with an even router, T k (N-1)/N assignments leave each rank.
The all-to-alls are differentiable (``AllToAllSingle``: backward swaps the split sizes), so the
experts' and the router's gradients come back by the same path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from d2lpar.strategies.expert.moe import Experts, check_moe, check_tokens, route

__all__ = ["AllToAllSingle", "check_same_moe", "ExpertParallelMoE"]


class AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], counter):
        ctx.splits, ctx.counter = (send, recv), counter
        return _a2a(x, send, recv, counter)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        return _a2a(grad.contiguous(), recv, send, None), None, None, None


def _a2a(x, send, recv, counter):
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send)
    if counter is not None:
        me = dist.get_rank()
        row = x.shape[1:].numel() * x.element_size()   # bytes per token row, even if x is empty
        away = sum(n for p, n in enumerate(send) if p != me)   # rows for other ranks
        counter["sent"] = counter.get("sent", 0) + away * row
        got = sum(n for p, n in enumerate(recv) if p != me)   # rows other ranks sent here
        counter["received"] = counter.get("received", 0) + got * row
    return out


def check_same_moe(sizes: dict[str, int]) -> None:
    """Raise on every rank, naming the values, if the ranks built different mixtures (before any
    rank blocks in an all-to-all whose sizes they would not agree on)."""
    mine = torch.tensor(list(sizes.values()), dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    for r, theirs in enumerate(every):
        for (name, a), b in zip(sizes.items(), theirs.tolist()):
            if a != b:
                raise ValueError(f"the ranks disagree on the mixture: rank {dist.get_rank()} has "
                                 f"{name}={a}, rank {r} has {name}={b}; build the same MoE on "
                                 "every rank")


class ExpertParallelMoE(nn.Module):
    """This rank's part of ``moe.MoE``: the whole router, experts ``rank * E/N ...`` only.

    ``full``: a single-device ``MoE`` to copy the router and this rank's experts from; its router
    must be the same on every rank (checked). Without it every rank takes rank 0's router (a
    broadcast): ranks seeded apart would otherwise route by different routers.
    """

    def __init__(self, d: int, hidden: int, experts: int, k: int = 1,
                 capacity_factor: float | None = None, full: nn.Module | None = None):
        super().__init__()
        check_moe(d, experts, k, capacity_factor)
        n, rank = dist.get_world_size(), dist.get_rank()
        check_same_moe({"E": experts, "d": d, "hidden": hidden, "k": k})
        if experts % n:
            raise ValueError(f"E = {experts} experts do not divide over {n} ranks: use a multiple "
                             f"of {n}")
        self.E, self.k, self.capacity_factor, self.local = experts, k, capacity_factor, experts // n
        self.first = rank * self.local
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = Experts(self.local, d, hidden)
        if full is not None:
            with torch.no_grad():
                self.router.weight.copy_(full.router.weight)
                self.experts.w1.copy_(full.experts.w1[self.first:self.first + self.local])
                self.experts.w2.copy_(full.experts.w2[self.first:self.first + self.local])
        self._same_router(full is None)
        self.last, self.counter = None, {}

    def _same_router(self, take_rank_0s: bool) -> None:
        """Every rank routes by rank 0's router: taken from it, or checked against it."""
        if take_rank_0s:
            dist.broadcast(self.router.weight.data, 0)
            return
        ref = self.router.weight.detach().clone()
        dist.broadcast(ref, 0)
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, torch.tensor([int(not torch.equal(ref, self.router.weight))]))
        bad = [r for r, f in enumerate(flags) if f.item()]
        if bad:
            raise ValueError(f"the ranks' full= mixtures differ: rank 0's router is not rank "
                             f"{bad[0]}'s; build full with the same seed on every rank "
                             "(MoE(..., seed=s)), or leave it out to take rank 0's router")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = dist.get_world_size()
        check_tokens(x, self.router.in_features)
        r = self.last = route(self.router(x), self.k, self.capacity_factor)
        token, choice = r.kept.nonzero(as_tuple=True)
        expert = r.expert[token, choice]
        order = torch.argsort(expert, stable=True)              # 2. grouped by expert, so by rank
        token, choice, expert = token[order], choice[order], expert[order]
        per_expert = torch.bincount(expert, minlength=self.E)
        got = torch.empty_like(per_expert)                       # 3. counts first
        dist.all_to_all_single(got, per_expert)
        send = per_expert.view(n, self.local).sum(1).tolist()
        from_rank = got.view(n, self.local)                      # [source rank, my expert]
        recv = from_rank.sum(1).tolist()
        arrived = AllToAllSingle.apply(x[token], send, recv, self.counter)   # 4. dispatch
        outs, start = [], 0                                       # 5. my experts
        for src in range(n):
            for e in range(self.local):
                size = int(from_rank[src, e])
                outs.append(self.experts(arrived[start:start + size], e))
                start += size
        back = AllToAllSingle.apply(torch.cat(outs) if outs else arrived, recv, send,   # 6.
                                    self.counter)
        weighted = back * r.weight[token, choice, None]
        return torch.zeros_like(x).index_add(0, token, weighted)
