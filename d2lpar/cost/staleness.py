"""Synchronous and asynchronous data-parallel SGD: what a stale gradient does to training.

Synchronous: every step, n workers compute gradients at the *current* parameters, the gradients are
averaged, and one update is made:

    w_{t+1} = w_t - lr * (1/n) sum_k g_k(w_t),

which is exactly SGD on the n shards taken as one batch (``sync_sgd`` checks it). The step waits for
the slowest worker.

Asynchronous (a parameter server that never waits): a worker pushes a gradient computed at the
parameters it pulled some updates ago; the others have moved the parameters meanwhile:

    w_{t+1} = w_t - lr * g(w_{t - tau}),

with tau about n - 1 for n equally fast workers. ``delayed_sgd`` simulates this deterministically
(round-robin workers, a fixed delay tau), so its curves are reproducible; a real asynchronous run only
adds randomness to tau. A delay in a feedback loop makes it overshoot: on the quadratic f(w) = h w^2/2,
w_{t+1} = w_t - a w_{t-tau} with a = lr h converges exactly when

    0 < a < 2 sin(pi / (2 (2 tau + 1))),

which is 2 for tau = 0 and about pi / (2 tau + 1) for large tau: the usable learning rate shrinks
roughly like 1/tau (``stability_bound``, ``delayed_quadratic``).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from typing import Sequence

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

__all__ = ["stability_bound", "delayed_quadratic", "delayed_sgd", "sync_sgd", "full_loss", "make_batches"]


def stability_bound(tau: int) -> float:
    """Largest a = lr * curvature for which gradient descent with delay tau converges."""
    if tau < 0:
        raise ValueError(f"the delay tau must be >= 0, got {tau}")
    return 2 * math.sin(math.pi / (2 * (2 * tau + 1)))


def delayed_quadratic(a: float, tau: int, steps: int = 200, w0: float = 1.0) -> list[float]:
    """The iterates of w_{t+1} = w_t - a * w_{t-tau} (w_t = w0 before the start)."""
    history = [w0] * (tau + 1)
    for _ in range(steps):
        history.append(history[-1] - a * history[-1 - tau])
    return history[tau:]


def full_loss(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return nn.functional.cross_entropy(model(X), y).item()


def _grad_at(worker: nn.Module, w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    vector_to_parameters(w, worker.parameters())
    worker.zero_grad(set_to_none=False)
    nn.functional.cross_entropy(worker(X), y).backward()
    return parameters_to_vector(p.grad for p in worker.parameters())


def delayed_sgd(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], lr: float,
                tau: int, eval_data: tuple[torch.Tensor, torch.Tensor], eval_every: int = 10,
                diverged: float = 1e3) -> tuple[list[float], nn.Module]:
    """SGD where update t uses the gradient at the parameters of update t - tau.

    Returns the loss on ``eval_data`` before every ``eval_every``-th update and once more after the
    last one (stopping early, with ``inf``, once it exceeds ``diverged``), and the trained copy of
    ``model`` (``model`` itself is left unchanged).
    """
    if tau < 0:
        raise ValueError(f"tau (how many updates old a gradient is) must be >= 0, got {tau}")
    trained, worker = copy.deepcopy(model), copy.deepcopy(model)
    w = parameters_to_vector(trained.parameters()).detach().clone()
    past: deque[torch.Tensor] = deque([w.clone()] * (tau + 1), maxlen=tau + 1)
    losses: list[float] = []
    for t, (X, y) in enumerate(batches):
        if t % eval_every == 0:
            vector_to_parameters(w, trained.parameters())
            losses.append(full_loss(trained, *eval_data))
            if not losses[-1] <= diverged:  # catches nan as well
                losses[-1] = math.inf
                break
        w = w - lr * _grad_at(worker, past[0], X, y)  # past[0] is w_{t - tau}
        past.append(w.clone())
    else:  # no divergence: the loss after the last update too
        vector_to_parameters(w, trained.parameters())
        losses.append(full_loss(trained, *eval_data))
        if not losses[-1] <= diverged:
            losses[-1] = math.inf
    vector_to_parameters(w, trained.parameters())
    return losses, trained


def sync_sgd(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], lr: float,
             workers: int) -> nn.Module:
    """Synchronous data parallelism: each batch is split over ``workers``, gradients averaged.

    Shards are cut with ``d2lpar.infra.data.split_sizes`` and weighted by their size, so the average
    is the gradient of the whole batch even when the batch does not divide evenly.
    """
    from d2lpar.infra.data import split_sizes
    trained, worker = copy.deepcopy(model), copy.deepcopy(model)
    w = parameters_to_vector(trained.parameters()).detach().clone()
    for X, y in batches:
        sizes = split_sizes(len(X), workers)
        grads = [_grad_at(worker, w, Xs, ys) * (len(Xs) / len(X))
                 for Xs, ys in zip(X.split(sizes), y.split(sizes)) if len(Xs)]
        w = w - lr * torch.stack(grads).sum(0)  # what an all-reduce (sum) of weighted grads gives
    vector_to_parameters(w, trained.parameters())
    return trained


def make_batches(X: torch.Tensor, y: torch.Tensor, batch_size: int, steps: int,
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` mini-batches drawn by reshuffling (X, y) each epoch, reproducibly."""
    gen, out = torch.Generator().manual_seed(seed), []
    while len(out) < steps:
        order = torch.randperm(len(X), generator=gen)
        out += [(X[i], y[i]) for i in order.split(batch_size) if len(i) == batch_size]
    return out[:steps]

