"""The same training with PyTorch's own API, on this rank: ``DistributedDataParallel``,
FSDP2's ``fully_shard`` (every block, then the model) and ``parallelize_module``
(``ColwiseParallel`` on QKV and fc1, ``RowwiseParallel`` on out and fc2, the layouts of
notebook 12). The model, the masks, the loss rule and the data rule are those of ``runners``; only
who cuts the model and reduces the gradients changes. At the checked steps the weights and
gradients come back whole (``full_tensor()`` of every DTensor: a collective on every rank).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from d2lpar.strategies.agreement.layouts import Layout, global_tokens_of
from d2lpar.strategies.agreement.model import Block, Config, at, build, token_loss
from d2lpar.strategies.agreement.rules import Norm

__all__ = ["wrap", "train_torch"]


def wrap(lay: Layout, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` under torch's API for ``lay.kind`` (the same model built on every rank)."""
    if lay.kind == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (lay.world,))
    if lay.kind == "fully_shard":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, Block):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    plan = {"qkv": ColwiseParallel(), "out": RowwiseParallel(),
            "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    for layer in model:
        if isinstance(layer, Block):
            parallelize_module(layer, mesh, plan)
    return model


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().float()


def train_torch(lay: Layout, cfg: Config, batches, steps: int, checks: tuple, lr: float) -> dict:
    """``runners.train_course`` for torch's kinds: each rank builds the model, torch cuts it."""
    rank = dist.get_rank()
    coords = {"dp": rank if lay.dp > 1 else 0, "tp": rank if lay.tp > 1 else 0, "pp": 0, "cp": 0}
    plain = build(cfg, lay.init)             # every rank the whole model; torch cuts it
    model = wrap(lay, plain)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    bf16 = lay.dtype == "bf16"
    scored, out_parts = [], {}
    for step in range(1, steps + 1):
        X, Y = batches[step - 1]
        B = len(X)
        a, b = lay.data(B, lay.dp, coords["dp"])
        norm = Norm(global_tokens_of(lay, Y), 1, lay.dp)
        opt.zero_grad(set_to_none=True)
        with at(step=step, rows=(a, B), seq=(0, cfg.seq), coords=coords, rule=lay.dropout,
                seed=cfg.seed, p=cfg.p), warnings.catch_warnings(), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            # FSDP2 warns that the model's output (a Linear's, reshaped) is a view: nothing here
            # changes it in place
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            total, tokens = token_loss(model(X[a:b]), Y[a:b])
            loss = lay.loss(total, tokens, norm)
        loss.backward()
        if step in checks:   # whole tensors, on every rank (full_tensor is a collective)
            named = list(plain.named_parameters())
            out_parts[step] = {
                "weights": {k: (_all(p), _whole(p)) for k, p in named},
                "grads": {k: (_all(p), _whole(p.grad)) for k, p in named if p.grad is not None}}
        opt.step()
        scored.append((total.item(), tokens) if lay.dp > 1 or rank == 0 else None)
    return {"scored": scored, "parts": out_parts, "coords": coords}


def _all(p) -> tuple:
    return tuple(slice(0, n) for n in p.shape)   # a DTensor's shape is the global one
