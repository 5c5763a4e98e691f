"""The rules a parallel trainer must get right for its loss curve to be one device's, and the ways
each is commonly broken (planted in notebook 18; the checker must catch every one).

**Random numbers** (a rule maps a ``model.Draw`` to uniform numbers of the rank's local shape):

* ``one_device``: draw the tensor as one device would, keep this rank's part. Replicated tensors
  then get equal masks on every rank that holds them, sharded tensors different ones, and every
  layout the same numbers as one device.
* ``same_seed_local`` (broken): each rank draws its own part's shape from the same key, so the
  parts held by different tensor ranks are copies: copied weight shards at initialisation (the
  SmolLM3 run restarted after 1T tokens for identical seeds on its TP = 2 ranks: Hugging Face's
  Smol training playbook, 2025, "Mystery #4"), equal dropout masks on features that different
  ranks hold.
* ``per_rank_where_replicated`` (broken): a replicated tensor keyed by the tensor rank (Megatron's
  tensor-parallel stream, seed + 2718 + tp rank, used outside the split region): its masks differ
  on ranks that must hold the same activations, so tensor parallelism without sequence parallelism
  carries a different residual stream on each rank. Under sequence parallelism no dropout input is
  replicated (each rank drops its own positions), and per-rank masks there are Megatron's own rule
  (``transformer_block.py`` forks the tensor-parallel stream): not one device's numbers, not a bug.

**Loss normalisation** (``rule(total, tokens, norm)``: the scalar a micro-batch backpropagates, from
its summed cross-entropy ``total`` over its ``tokens`` real tokens; the gradient reducers then
*average* over ``norm.replicas`` ranks that read different data):

* ``global_tokens``: total / N x replicas, N the real tokens of the whole global batch: every token
  weighs 1/N whatever micro-batch or rank it is on (torchtitan's ``global_valid_tokens``,
  torchtitan/trainer.py; it sums instead of averaging, ``disable_fsdp_gradient_division`` in
  torchtitan/distributed/fsdp.py, which is the same as multiplying by the replicas here).
* ``per_microbatch_mean`` (broken): each micro-batch's own mean, averaged over micro-batches and
  ranks: a token of a short micro-batch weighs more (torchtitan PR #2206, torchtune PR #1875).
* ``microbatches_twice`` (broken): the loss divided by the number of micro-batches once more, by a
  loop written for gradient accumulation inside a pipeline schedule that divides already
  (``scale_grads=True`` in torch.distributed.pipelining): gradients 1/m of one device's.

**Data** (``rule(rows, dp, dp_rank) -> (start, stop)``: the rows of the global batch a
data-parallel rank reads): ``own_rows`` (each rank its own consecutive share, ``chunk_bounds``) and
``same_rows`` (broken: every rank the first share, as a sampler built without ``rank=`` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d2lpar.infra.data import chunk_bounds
from d2lpar.strategies.agreement.model import Draw, key_of

__all__ = ["one_device", "same_seed_local", "per_rank_where_replicated", "Norm", "global_tokens",
           "per_microbatch_mean", "microbatches_twice", "own_rows", "same_rows"]


# ---------------------------------------------------------------------------------- random numbers

def one_device(d: Draw) -> torch.Tensor:
    """Draw the whole tensor as one device would, keep this rank's part."""
    g = torch.Generator().manual_seed(key_of(d.seed, d.what, d.step))
    return torch.rand(d.shape, generator=g)[d.index]


def same_seed_local(d: Draw) -> torch.Tensor:
    """Broken: each rank draws the shape of its own part from the same key (copies across ranks)."""
    g = torch.Generator().manual_seed(key_of(d.seed, d.what, d.step))
    return torch.rand(d.local_shape, generator=g)


def per_rank_where_replicated(d: Draw) -> torch.Tensor:
    """Broken: a replicated tensor's key depends on the tensor rank (masks differ on replicas)."""
    if d.sharded:
        return one_device(d)
    g = torch.Generator().manual_seed(key_of(d.seed, d.what, d.step) + 2718 + d.coords["tp"])
    return torch.rand(d.shape, generator=g)[d.index]


# ------------------------------------------------------------------------------ loss normalisation

@dataclass(frozen=True)
class Norm:
    global_tokens: int    # real tokens in the whole global batch (every rank's rows)
    microbatches: int     # micro-batches per rank in this step
    replicas: int         # ranks whose gradients are averaged (data x context parallel)


def global_tokens(total: torch.Tensor, tokens: int, norm: Norm) -> torch.Tensor:
    """Every token of the global batch weighs 1/N; x replicas undoes the reducers' average."""
    return total / norm.global_tokens * norm.replicas


def per_microbatch_mean(total: torch.Tensor, tokens: int, norm: Norm) -> torch.Tensor:
    """Broken: each micro-batch's mean, then the mean over micro-batches (and, by the reducer,
    over ranks)."""
    return total / max(tokens, 1) / norm.microbatches


def microbatches_twice(total: torch.Tensor, tokens: int, norm: Norm) -> torch.Tensor:
    """Broken: the right loss divided by the micro-batches once more (the schedule did already)."""
    return global_tokens(total, tokens, norm) / norm.microbatches


# ------------------------------------------------------------------------------------------- data

def own_rows(rows: int, dp: int, rank: int) -> tuple[int, int]:
    """Data-parallel rank ``rank`` reads its own consecutive share of the global batch."""
    return chunk_bounds(rows, dp)[rank]


def same_rows(rows: int, dp: int, rank: int) -> tuple[int, int]:
    """Broken: every data-parallel rank reads the first share."""
    return chunk_bounds(rows, dp)[0]
