"""PyTorch's context parallelism: scaled_dot_product_attention over a sequence split across GPUs.

torch only: no d2lpar. ``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` shards the
listed tensors along their sequence dimension over the mesh's ranks, in place, and inside the
context every ``scaled_dot_product_attention`` call runs as ring attention (the key/value shards
travel around the ranks). The script checks the attention's output against one GPU's on the whole
sequence. GPUs only in torch 2.14: the CPU attention kernel has no sharding rule, so on CPUs the
script says so and stops (notebook 15 builds ring attention by hand, on CPUs too).

    torchrun --standalone --nproc-per-node=2 context_parallel_torch.py --seq 4096
    python context_parallel_torch.py                      # one GPU, world size 1
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


class Usage(Exception):  # bad input: printed as one sentence, without a traceback
    pass


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description="context_parallel against one GPU (torch only).")
    p.add_argument("--seq", type=int, default=4096, help="tokens; a multiple of 2 x the world size")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise Usage("context_parallel needs CUDA GPUs in torch 2.14 (the CPU attention kernel has "
                    "no sharding rule): run this on GPUs, or build ring attention by hand "
                    "(notebook 15)")
    names = ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if "RANK" in os.environ and (missing := [n for n in names if not os.environ.get(n)]):
        raise Usage(f"{', '.join(missing)} not set: start with torchrun, which sets them with RANK")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.seq % (2 * world):
        raise Usage(f"--seq {args.seq} must be a multiple of 2 x {world} ranks "
                    "(the load-balanced split)")
    if "RANK" not in os.environ:   # one GPU: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="29511")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    try:
        mesh = init_device_mesh("cuda", (world,))
        g = torch.Generator(device="cuda").manual_seed(0)   # the same tensors on every rank
        q, k, v = (torch.randn(1, args.heads, args.seq, args.head_dim, device="cuda", generator=g,
                               dtype=torch.bfloat16) for _ in range(3))
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (full,) = context_parallel_unshard(mesh, [out], [2])
        err = (full.float() - expected.float()).abs().max().item()
        print(f"rank {dist.get_rank()} of {world}: max |context_parallel - one GPU| = {err:.2e}")
        return err
    finally:
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys
    try:
        main()
    except Usage as e:
        sys.exit(f"context_parallel_torch.py: error: {e}")
