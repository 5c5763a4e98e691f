"""A mixture-of-experts MLP on one device: a router picks k of E experts per token.

**Routing.** The router is a linear layer giving each token E logits; softmax turns them into
probabilities p_e, each token goes to its k most probable experts, and its output is the sum of
those experts' outputs weighted by their probabilities renormalised over the k (for k = 1: p_e
itself, as in Switch Transformer, so the router gets a gradient).

**Capacity.** An expert takes at most C = ceil(capacity_factor * T k / E) of the T tokens (T k
assignments spread over E experts, times a margin). Assignments beyond C, in token order, are
*dropped*: that choice contributes nothing (the token passes through the residual outside this
layer). Dropped = sum_e max(0, n_e - C) for n_e assignments to expert e.

**Load balancing.** Nothing stops the router from sending most tokens to a few experts (which then
drop them, and whose ranks do all the work). The auxiliary loss of Switch Transformer,

    aux = E * sum_e f_e P_e,   f_e = fraction of assignments to e,
    P_e = mean router probability of e,

is 1 for a perfectly even router and grows as the load concentrates; adding alpha * aux (alpha ~
0.01) to the loss pushes the router towards balance (f_e carries no gradient, P_e does).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["check_moe", "check_tokens", "Routing", "route", "capacity", "Experts", "MoE"]


def check_moe(d: int, experts: int, k: int, capacity_factor: float | None) -> None:
    if experts < 1 or d < 1:
        raise ValueError(f"experts={experts}, d={d}: a mixture needs at least 1 expert of width >= "
                         "1")
    if not 1 <= k <= experts:
        raise ValueError(f"k={k}: a router picks between 1 and E = {experts} experts per token")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor}: give a number above 0 (1.0: room for "
                         "an "
                         "even split; None: no limit)")
    if capacity_factor is not None and not math.isfinite(capacity_factor):
        raise ValueError(f"capacity_factor={capacity_factor}: give a finite number above 0 (None: "
                         "no limit)")


def check_tokens(x: torch.Tensor, d: int) -> None:
    """The mixture routes tokens, one per row: (T, d)."""
    if x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"the mixture takes tokens as rows (T, d={d}), got shape "
                         f"{tuple(x.shape)}: flatten them, x.reshape(-1, {d})")


def capacity(tokens: int, k: int, experts: int, capacity_factor: float | None) -> int:
    """C = ceil(capacity_factor * T k / E); no limit (T k) when capacity_factor is None."""
    if capacity_factor is None:
        return tokens * k
    return math.ceil(capacity_factor * tokens * k / experts)


class Routing:
    """Which experts each token goes to: ``expert`` and ``weight`` (T, k), ``kept`` (T, k)
    booleans."""

    def __init__(self, expert, weight, kept, probs):
        self.expert, self.weight, self.kept, self.probs = expert, weight, kept, probs

    @property
    def counts(self) -> torch.Tensor:
        """Assignments per expert, before dropping."""
        return torch.bincount(self.expert.flatten(), minlength=self.probs.shape[1])

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())

    def aux_loss(self) -> torch.Tensor:
        """E sum_e f_e P_e; 0 for no tokens (nothing to balance; 0/0 would be nan)."""
        E = self.probs.shape[1]
        if self.expert.numel() == 0:
            return self.probs.sum() * 0.0   # zero, still in the router's graph
        f = self.counts.float() / self.expert.numel()
        return E * (f * self.probs.mean(0)).sum()


def route(logits: torch.Tensor, k: int, capacity_factor: float | None) -> Routing:
    """Top-k routing of T tokens (logits (T, E)) with the capacity rule above."""
    T, E = logits.shape
    probs = logits.softmax(-1)
    top, expert = probs.topk(k, -1)
    weight = top if k == 1 else top / top.sum(-1, keepdim=True)
    C = capacity(T, k, E, capacity_factor)
    # position of each assignment in its expert's queue, in token order (first choices first)
    flat = expert.t().reshape(-1)   # choice-major: every token's 1st, then 2nd
    onehot = F.one_hot(flat, E)
    position = ((onehot.cumsum(0) - 1) * onehot).sum(-1)
    kept = (position < C).view(k, T).t()
    return Routing(expert, weight, kept, probs)


class Experts(nn.Module):
    """E independent two-layer MLPs (d -> hidden -> d), weights stacked: ``forward(x, e)``."""

    def __init__(self, experts: int, d: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, d, hidden) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, d) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return F.gelu(x @ self.w1[e]) @ self.w2[e]


class MoE(nn.Module):
    """The whole layer on one device: route, run each expert on its kept tokens, combine."""

    def __init__(self, d: int, hidden: int, experts: int, k: int = 1,
                 capacity_factor: float | None = None, seed: int = 0):
        super().__init__()
        check_moe(d, experts, k, capacity_factor)
        torch.manual_seed(seed)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = Experts(experts, d, hidden)
        self.k, self.capacity_factor, self.E = k, capacity_factor, experts
        self.last: Routing | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, d) -> (T, d); the routing is kept in ``self.last`` (counts, drops, aux loss)."""
        check_tokens(x, self.router.in_features)
        r = self.last = route(self.router(x), self.k, self.capacity_factor)
        out = torch.zeros_like(x)
        for e in range(self.E):
            token, choice = ((r.expert == e) & r.kept).nonzero(as_tuple=True)
            if len(token):
                y = self.experts(x[token], e) * r.weight[token, choice, None]
                out = out.index_add(0, token, y)
        return out
