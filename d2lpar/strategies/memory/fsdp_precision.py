"""FSDP2's mixed precision, seen in its collectives: which dtype each all-gather and reduce-scatter
moves.

``fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype))`` keeps the sharded
parameters in fp32 and casts them to ``param_dtype`` *before* the all-gather (so the gather moves
half the bytes in bf16), computes forward and backward in ``param_dtype``, and casts the gradients
to ``reduce_dtype`` before the reduce-scatter; the sharded gradient that AdamW sees is fp32 again.
``reduce_dtype=fp32`` sums the ranks' gradients in fp32 (each rank's bf16 gradient rounded once);
``reduce_dtype=bf16`` sums in bf16, halving the bytes and adding the rounding of the sum, which
grows with the number of ranks. Learners often assume the reduction follows ``param_dtype``: it does
when ``reduce_dtype`` is left None.

``recording_collectives`` wraps the two functions FSDP2 calls (``dist.all_gather_single`` and
``dist.reduce_scatter_single``) so that a test can assert the dtypes instead of trusting the policy.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["recording_collectives", "tiny_model", "fsdp_policy_run", "single_process_run"]


@contextlib.contextmanager
def recording_collectives(log: list):
    """Append (kind, dtype name, elements) to ``log`` for every FSDP2 all-gather and
    reduce-scatter."""
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def gather_logged(output_tensor, input_tensor, *args, **kwargs):
        log.append(("all_gather", str(input_tensor.dtype).removeprefix("torch."),
                    input_tensor.numel()))
        return gather(output_tensor, input_tensor, *args, **kwargs)

    def scatter_logged(output, input, *args, **kwargs):
        log.append(("reduce_scatter", str(input.dtype).removeprefix("torch."), input.numel()))
        return scatter(output, input, *args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = gather_logged, scatter_logged
    try:
        yield log
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter


def tiny_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))


def _data(rank: int, micro: int, steps: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [[(torch.randn(8, 32, generator=g), torch.randn(8, 8, generator=g))
             for _ in range(micro)]
            for _ in range(steps)]


def fsdp_policy_run(param_dtype, reduce_dtype, steps: int = 3, micro: int = 1, lr: float = 1e-2):
    """In a launched rank: train ``tiny_model`` sharded with the policy (AdamW, ``micro``
    micro-batches accumulated with ``set_requires_gradient_sync``); return the collectives logged
    per micro-batch of the last step, the first step's gradients as AdamW receives them (gathered
    whole, fp32) and the full trained weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = tiny_model()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    per_micro, first_grads = [], None
    for batches in _data(dist.get_rank(), micro, steps):
        per_micro = []
        for i, (X, y) in enumerate(batches):
            model.set_requires_gradient_sync(i == micro - 1)   # reduce-scatter only on the last
            with recording_collectives([]) as log:
                (nn.functional.mse_loss(model(X).float(), y) / micro).backward()
            per_micro.append(log)
        if first_grads is None:   # the gradients AdamW's first step sees (it ignores their scale)
            first_grads = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    weights = {k: v.full_tensor().detach().float() for k, v in model.state_dict().items()}
    return {"collectives": per_micro, "grads": first_grads, "weights": weights}


def single_process_run(world: int, steps: int = 3, micro: int = 1, lr: float = 1e-2,
                       grads: dict | None = None):
    """The same training in fp32 in one process: every rank's micro-batches, averaged; returns the
    trained weights, and fills ``grads`` (if given) with the first step's gradients."""
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = [_data(r, micro, steps) for r in range(world)]
    for step in range(steps):
        for r in range(world):
            for X, y in data[r][step]:
                (nn.functional.mse_loss(model(X), y) / (micro * world)).backward()
        if step == 0 and grads is not None:
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}
