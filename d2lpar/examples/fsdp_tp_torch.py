"""FSDP2 across data-parallel ranks, tensor parallelism inside each group: one file, torch only.

torch only: no d2lpar. The ranks form a dp x tp grid (``init_device_mesh``); each tp row splits
every MLP's first Linear by columns and its second by rows (``parallelize_module``), ``fully_shard``
shards that over the dp column, ``torch.optim.AdamW`` steps the shards, ``get_state_dict`` +
``dcp.save`` write them (each rank its shards and their index; rank 0 merges the indexes); a rerun
with the same ``--out`` resumes (``dcp.load`` + ``set_state_dict``) on any grid. ``--batch-size``
is global: a dp group takes B/dp rows (the same on its tp ranks), so any grid ends with one
process's weights. It needs nothing but torch (no numpy: it sends no pickled object between ranks).
CPUs (gloo) or a GPU per process (NCCL), as is:

    python fsdp_tp_torch.py --out ckpt                                    # one process, no mesh
    torchrun --standalone --nproc-per-node=4 fsdp_tp_torch.py --out ckpt  # dp x tp = 2 x 2
"""

import argparse
import gc
import os
import pickle
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Usage(Exception):  # bad input: printed as one sentence, without a traceback
    pass


def who_am_i() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables; none set: one process."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return 0, 1, 0
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]
    if missing := [name for name in names if not os.environ.get(name)]:
        raise Usage(f"{', '.join(missing)} not set: start with torchrun, which sets all five")
    return tuple(int(os.environ[name]) for name in names[:3])


def make_data_and_model(seed: int, d: int = 16, hidden: int = 64):
    """batch(step, size): the global batch of a step, the same whatever ran before; two MLP blocks."""
    W = torch.randn(d, d, generator=torch.Generator().manual_seed(seed))  # targets: tanh(X W)

    def batch(step: int, size: int):
        X = torch.randn(size, d, generator=torch.Generator().manual_seed(seed + 1 + step))
        return X, torch.tanh(X @ W)

    torch.manual_seed(seed)  # the same full model on every rank, before it is cut
    block = lambda: nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))
    return batch, nn.Sequential(block(), block())


def merge_indexes(folder: str, world: int) -> None:
    """Write the checkpoint's one index, ``.metadata``, from the ranks' own (``__<r>.metadata``,
    which ``dcp.save(..., use_collectives=False)`` writes): every key, every rank's pieces (a piece
    that several ranks hold, once), where each lies. ``.metadata`` is a pickled ``Metadata``, as
    ``FileSystemWriter.finish`` writes it."""
    merged = None
    for r in range(world):
        index = dcp.FileSystemReader(folder).read_metadata(rank=r)
        if merged is None:
            merged = index
            continue
        for key, item in index.state_dict_metadata.items():
            have = merged.state_dict_metadata.setdefault(key, item)
            if have is not item and isinstance(item, TensorStorageMetadata):
                known = {tuple(c.offsets) for c in have.chunks}
                have.chunks += [c for c in item.chunks if tuple(c.offsets) not in known]
        merged.storage_data = {**index.storage_data, **merged.storage_data}
        merged.planner_data = {**(index.planner_data or {}), **(merged.planner_data or {})}
    with open(os.path.join(folder, ".metadata.tmp"), "wb") as f:
        pickle.dump(merged, f)
    os.replace(os.path.join(folder, ".metadata.tmp"), os.path.join(folder, ".metadata"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="FSDP2 + tensor parallelism on a 2D mesh (torch only).")
    p.add_argument("--out", required=True, help="checkpoint folder, visible to every rank")
    p.add_argument("--tp", type=int, default=2, help="ranks per tensor-parallel group")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="global batch, split over dp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU even where there are GPUs")
    args = p.parse_args(argv)
    rank, world, local_rank = who_am_i()
    tp = args.tp if world > 1 else 1
    if tp < 1 or world % tp:
        raise Usage(f"{world} processes do not make a dp x tp mesh with --tp {args.tp}: start a "
                    f"multiple of {args.tp} processes, or pass a --tp that divides {world}")
    dp = world // tp
    if args.batch_size % dp:
        raise Usage(f"--batch-size {args.batch_size} is the global batch and does not divide over "
                    f"{dp} data-parallel groups: use a multiple of {dp}")
    try:  # fail now, not after training
        os.makedirs(args.out, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as e:
        raise Usage(f"cannot write to --out {args.out} ({e.strerror}): give a folder you can write")
    if not args.cpu and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        torch.cuda.set_device(local_rank)  # a GPU of its own for every process on this node
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world > 1:
        dist.init_process_group(backend, rank=rank, world_size=world)
    # meant: a block returns a view (no in-place op follows), one process, a rerun overwrites
    for said in ("FSDP2-wrapped module", "torch.distributed is disabled", "Detected an existing"):
        warnings.filterwarnings("ignore", message=said)
    try:
        train(args, rank, dp, tp, device)
    finally:  # also after an error, so that no rank waits for a dead group
        if dist.is_initialized():
            gc.collect()  # what still holds the group (DDP, a schedule) goes now, not at exit
            dist.destroy_process_group()


def train(args, rank: int, dp: int, tp: int, device: torch.device) -> None:
    batch, net = make_data_and_model(args.seed)
    net, row = net.to(device), 0  # row: this rank's data-parallel group
    if dp * tp > 1:
        mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        for block in net:  # Megatron's pairing: column-parallel, then row-parallel
            parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])  # each block is a unit of FSDP2
        fully_shard(net, mesh=mesh["dp"])
        row = mesh.get_local_rank("dp")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    state, start = {"model": {}, "optim": {}, "step": 0}, 0
    if os.path.exists(os.path.join(args.out, ".metadata")):  # resume, whatever grid saved it
        state["model"], state["optim"] = get_state_dict(net, opt)
        dcp.load(state, checkpoint_id=args.out, no_dist=True)  # each rank reads its own pieces
        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["step"]
    per = args.batch_size // dp
    for step in range(start, args.steps):
        X, Y = (t[row * per:(row + 1) * per].to(device) for t in batch(step, args.batch_size))
        loss = nn.functional.mse_loss(net(X), Y)
        loss.backward()  # FSDP2 reduce-scatters each block's gradient over dp
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"rank 0 of {dp * tp} (dp {dp} x tp {tp}, {device}): step {step + 1}, "
                  f"loss on its rows {loss.item():.4f}", flush=True)
    model_state, optim_state = get_state_dict(net, opt)  # sharded DTensors: no rank gathers all
    # dcp.save's default agrees on one plan by sending pickled plans between ranks, and torch
    # unpickles a received object with tensor.numpy() (_tensor_to_object): without numpy, each
    # rank writes its shards and its own index (a piece held by several ranks, by each of them),
    # then rank 0 merges the indexes, and dcp.load reads the merged one on any grid.
    dcp.save({"model": model_state, "optim": optim_state, "step": args.steps},
             checkpoint_id=args.out, no_dist=dp * tp == 1, use_collectives=False)
    if rank == 0:
        merge_indexes(args.out, dp * tp)
    if dp * tp > 1:
        dist.barrier()  # every rank returns once the checkpoint is whole
    if rank == 0:
        where = net[0][0].weight.placements if dp * tp > 1 else "whole"
        print(f"saved to {args.out}; block 0's first weight placed {where}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except Usage as e:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {e}")
