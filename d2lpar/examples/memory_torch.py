"""Training with less memory: activation checkpointing, bf16 autocast and FSDP2's mixed precision.

torch only: no d2lpar. A stack of MLP blocks trained with AdamW, each block checkpointed
(``torch.utils.checkpoint.checkpoint``, ``use_reentrant=False``) or, with ``--selective``, keeping
only its matrix products (``create_selective_checkpoint_contexts``); under torchrun every block is
``fully_shard``-ed with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: bf16
all-gathers and compute, fp32 gradient reduction and fp32 sharded weights for AdamW. In one process
(no torchrun) the blocks run under ``torch.autocast(dtype=bfloat16)`` instead. CPUs (gloo) or a GPU
per process (NCCL), as is:

    python memory_torch.py --steps 5                                    # one process, bf16 autocast
    torchrun --standalone --nproc-per-node=2 memory_torch.py --steps 5  # FSDP2, bf16 policy
"""

import argparse
import functools
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


class Usage(Exception):  # bad input: printed as one sentence, without a traceback
    pass


MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


def save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


class Blocks(nn.Module):
    def __init__(self, d: int, depth: int, selective: bool):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)) for _ in range(depth))
        self.context = functools.partial(create_selective_checkpoint_contexts, save_matmuls) \
            if selective else None

    def forward(self, x):
        for block in self.blocks:   # each block keeps only its input (or its matmuls) for backward
            kw = {"context_fn": self.context} if self.context else {}
            x = x + checkpoint(block, x, use_reentrant=False, **kw)
        return x


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description="Checkpointing and mixed precision (torch only).")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--selective", action="store_true", help="save the matmuls, recompute the rest")
    args = p.parse_args(argv)
    for name in ("steps", "width", "depth", "batch_size"):
        if getattr(args, name) < 1:
            raise Usage(f"--{name.replace('_', '-')} {getattr(args, name)}: give at least 1")
    distributed = "RANK" in os.environ
    if distributed:
        missing = [n for n in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if n not in os.environ]
        if missing:
            raise Usage(f"{', '.join(missing)} not set: start with torchrun, which sets them")
        gpu = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if gpu:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if distributed and gpu else torch.device("cpu")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)   # the same model on every rank
    model = Blocks(args.width, args.depth, args.selective).to(device)
    if distributed:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)   # each rank its own data
    losses = []
    try:
        for step in range(args.steps):
            X = torch.randn(args.batch_size, args.width, generator=g).to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not distributed):
                out = model(X)
            loss = (out.float() - X).square().mean()   # learn the identity through the residuals
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            print(f"rank {rank}: step {step + 1}, loss {loss.item():.5f}", flush=True)
    finally:
        if distributed:
            gc.collect()
            dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    import sys
    try:
        main()
    except Usage as e:
        sys.exit(f"memory_torch.py: error: {e}")
