"""Pipeline parallelism in one file, torch only: ``torch.distributed.pipelining``, a manual split.

torch only: no d2lpar. Rank r of W keeps layers [r L/W, (r+1) L/W) of one ``nn.Sequential`` (the
same seed everywhere) in a ``PipelineStage``; ``ScheduleGPipe`` or ``Schedule1F1B`` runs each step
on m micro-batches, rank 0 feeding the batch, the last rank the targets. Each micro-batch's mean
loss, gradients divided by m (``scale_grads=True``): W ranks take one process's steps on the whole
batch. On CPUs (gloo) or a GPU per process (NCCL), as is:

    python pipeline_torch.py                        # one process: the whole model, no pipeline
    torchrun --standalone --nproc-per-node=2 pipeline_torch.py --schedule 1F1B --out run
"""

import argparse
import gc
import os
import sys
import tempfile
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


class Usage(Exception):  # bad input: printed as one sentence, without a traceback
    pass


def who_am_i() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables; one process without them."""
    env = os.environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return 0, 1, 0
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]
    if missing := [name for name in names if not env.get(name)]:
        raise Usage(f"{', '.join(missing)} not set: start with torchrun --standalone "
                    f"--nproc-per-node=N, which sets them all")
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])


def make_data_and_model(layers: int, batch: int, seed: int = 0) -> tuple:
    """A batch of 16 features whose class is the argmax of a fixed map; ``layers`` Linear+ReLU."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(batch, 16, generator=g)
    y = (X @ torch.randn(16, 4, generator=g)).argmax(1)
    torch.manual_seed(seed)  # the same weights on every rank: each keeps its slice
    body = [m for _ in range(layers - 1) for m in (nn.Linear(16, 16), nn.ReLU())]
    return X, y, nn.Sequential(*body, nn.Linear(16, 4))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="Pipeline parallelism, torch.distributed.pipelining.")
    p.add_argument("--schedule", choices=list(SCHEDULES), default="GPipe")
    p.add_argument("--layers", type=int, default=8, help="Linear layers, split evenly over ranks")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", help="folder: each rank saves its layers there as stage<r>.pt")
    args = p.parse_args(argv)
    rank, world, local_rank = who_am_i()
    if args.layers % world:
        raise Usage(f"--layers {args.layers} does not split evenly over {world} ranks: "
                    f"use a multiple of {world}")
    if args.microbatches < world:
        raise Usage(f"--microbatches {args.microbatches} is fewer than the {world} stages: "
                    f"use at least {world}")
    if args.batch_size % args.microbatches:
        raise Usage(f"--batch-size {args.batch_size} does not cut into {args.microbatches} equal "
                    f"micro-batches: use a multiple of {args.microbatches}")
    try:  # fail now, not after training
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            tempfile.TemporaryFile(dir=args.out).close()
    except OSError as e:
        raise Usage(f"cannot write to --out {args.out} ({e.strerror}): give a writable folder")
    gpus = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = torch.device("cuda", local_rank) if gpus else torch.device("cpu")
    if gpus:  # a GPU of its own for every process here
        torch.cuda.set_device(device)
    if world > 1:  # env:// reads MASTER_ADDR and MASTER_PORT
        dist.init_process_group("nccl" if gpus else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(minutes=2))
    try:
        return train(args, rank, world, device)
    finally:  # also after an error, so that no rank waits for a dead group
        if dist.is_initialized():
            gc.collect()  # what still holds the group (DDP, a schedule) goes now, not at exit
            dist.destroy_process_group()


def train(args, rank: int, world: int, device: torch.device) -> dict:
    X, y, model = make_data_and_model(args.layers, args.batch_size)
    per = args.layers // world * 2  # modules per rank: (Linear, ReLU) pairs, the last without ReLU
    lo, hi = rank * per, min((rank + 1) * per, len(model))
    # the same module names as in the whole model ("0.weight", "14.bias"): slices save side by side
    part = nn.Sequential(OrderedDict((str(i), model[i]) for i in range(lo, hi))).to(device)
    optimizer = torch.optim.SGD(part.parameters(), lr=0.1)
    last = rank == world - 1
    if world > 1:
        # A micro-batch's shapes in and out of this stage, given: otherwise the first step infers
        # them by sending them between stages as pickled objects, which needs numpy to unpickle.
        mb, width = args.batch_size // args.microbatches, 4 if last else 16
        into = torch.empty(mb, 16, device=device, requires_grad=rank > 0)  # rank 0's: the data
        out = torch.empty(mb, width, device=device, requires_grad=True)
        stage = PipelineStage(part, rank, world, device, input_args=into, output_args=out)
        loss_fn = nn.functional.cross_entropy  # per micro-batch; gradients divided by m
        sched = SCHEDULES[args.schedule](stage, args.microbatches, loss_fn=loss_fn)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        if world == 1:  # the reference: the whole batch in one process
            loss = nn.functional.cross_entropy(part(X.to(device)), y.to(device))
            loss.backward()
        else:
            losses = []  # the last rank gets one loss per micro-batch; rank 0 feeds the batch
            first = (X.to(device),) if rank == 0 else ()
            sched.step(*first, **(dict(target=y.to(device), losses=losses) if last else {}))
            loss = torch.stack(losses).mean() if last else None
        if last:
            if not torch.isfinite(loss):
                raise FloatingPointError(f"step {step + 1}: the loss is {loss.item()}")
            print(f"rank {rank} of {world} ({args.schedule if world > 1 else 'no pipeline'}, "
                  f"{device}): step {step + 1}, loss {loss.item():.6f}", flush=True)
        optimizer.step()
    state = {k: v.detach().cpu() for k, v in part.state_dict().items()}
    if args.out:  # each rank its own file: no rank holds the whole model
        torch.save(state, os.path.join(args.out, f"stage{rank}.pt"))
    return state


if __name__ == "__main__":
    try:
        main()
    except Usage as e:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {e}")
