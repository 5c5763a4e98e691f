"""Train LeNet on handwritten digits with DistributedDataParallel; the same file runs under any launcher.

    python d2lpar/examples/train_ddp.py                                       # one plain process
    torchrun --standalone --nproc-per-node=2 d2lpar/examples/train_ddp.py     # one node, 2 processes
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=8 --master-addr=HOST0 --master-port=29500 \\
        d2lpar/examples/train_ddp.py             # on node 0; the same with --node-rank=1 on node 1
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29400 \\
        --rdzv-id=job42 --max-restarts=3 d2lpar/examples/train_ddp.py   # elastic: same on every node
    python -m torch.distributed.launch --nproc-per-node=2 d2lpar/examples/train_ddp.py  # deprecated
    srun --ntasks=16 --ntasks-per-node=8 python d2lpar/examples/train_ddp.py           # SLURM

What makes it work everywhere (each step is a comment below):
1. ``d2lpar.processes.env.detect()`` reads rank, world size and local rank from torchrun, the legacy launcher
   (``--local-rank``) or SLURM, and says one plain process when there is no launcher.
2. One GPU per process (``cuda:<local rank>``, NCCL) when there are enough GPUs, else CPU and gloo.
3. ``--batch-size`` is the *global* batch: each of W ranks takes B/W examples per step, and since
   DDP averages gradients over ranks, a step equals one step on the whole batch in one process.
4. ``DistributedSampler`` with ``set_epoch(epoch)``: a new shuffle every epoch, the same on all ranks.
5. Rank 0 writes an atomic checkpoint after each epoch (``d2lpar.processes.checkpoint.save``); every rank
   resumes from it on start, so ``torchrun --max-restarts`` continues a job whose process died.
   The checkpoint folder must be visible to all nodes (a shared file system).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from d2lpar.processes import checkpoint, env
from d2lpar.infra.data import load_digits
from d2lpar.infra.models import lenet


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train_ddp.py", description="Train LeNet with DDP under any launcher.")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="global batch, split over all ranks")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--train-size", type=int, default=None, help="use the first N training images (default: all)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    p.add_argument("--ckpt-dir", default=None, help="where last.pt lives (default: no checkpoints)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU with gloo even if GPUs exist")
    p.add_argument("--world-size", type=int, default=None,
                   help="the world size you expect; an error if the launcher started another")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for rendezvous/collectives")
    # The legacy launcher appends --local-rank=N (--local_rank=N before PyTorch 2.0); accept both.
    p.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    problem = argument_problem(args)
    if problem:
        p.error(problem)   # usage, then "train_ddp.py: error: ...", exit status 2
    return args


def argument_problem(args: argparse.Namespace) -> str | None:
    """The first option that cannot work, in one sentence, found before any process group or epoch
    (an unwritable checkpoint folder would otherwise fail only after the first epoch's work)."""
    if args.epochs < 1:
        return f"--epochs {args.epochs}: train at least 1 epoch"
    if args.train_size is not None and args.train_size < 1:
        return f"--train-size {args.train_size}: give a positive number of images, or leave it out for all"
    if args.batch_size < 1:
        return f"--batch-size {args.batch_size}: the global batch needs at least 1 example per process"
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        return (f"--timeout {args.timeout}: give the seconds a rank may wait for the others, a "
                "finite number above 0 (e.g. 120)")
    if not math.isfinite(args.lr):
        return f"--lr {args.lr}: give a finite learning rate (e.g. 0.05)"
    if args.ckpt_dir:
        try:   # every rank may write the checkpoint's temporary file: try it now
            os.makedirs(args.ckpt_dir, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=args.ckpt_dir):
                pass
        except OSError as e:
            return (f"--ckpt-dir {args.ckpt_dir} cannot be written ({e.strerror or e}): choose a "
                    "folder this process can write to (on a file system every node sees)")
    return None


class DeviceMismatch(env.EnvError):
    """The GPUs this process sees do not give every process on the node a GPU of its own."""


def choose_device(who: env.DistEnv, cpu: bool = False) -> tuple[torch.device, str]:
    """One GPU per process with NCCL, else CPU and gloo. A process that sees exactly one GPU (srun
    --gpus-per-task=1, torchrun --virtual-local-rank) takes it as cuda:0; one that sees several
    takes cuda:LOCAL_RANK when there is one per local process; some, but fewer, is refused with
    one sentence rather than quietly training on the CPU."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cpu or visible == 0:
        return torch.device("cpu"), "gloo"
    index = 0 if visible == 1 else who.local_rank
    if visible > 1 and visible < who.local_world_size:
        raise DeviceMismatch(
            f"this process sees {visible} GPUs but {who.local_world_size} processes run on this "
            f"node: bind one GPU per process (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES), "
            f"start at most {visible} per node, or pass --cpu")
    torch.cuda.set_device(index)
    return torch.device("cuda", index), "nccl"


def log(who: env.DistEnv, *message) -> None:
    """Only rank 0 talks, so W processes do not print everything W times."""
    if who.is_main:
        print(*message, flush=True)


def progress(who: env.DistEnv, text: str, step: int, steps: int, width: int = 20) -> None:
    """A progress bar on rank 0: redrawn in place on a terminal, one line per epoch otherwise."""
    if not who.is_main:
        return
    done = width * step // steps
    line = f"{text} [{'#' * done}{'.' * (width - done)}] {step}/{steps}"
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if step == steps else "", flush=True)
    elif step == steps:
        print(line, flush=True)


@torch.no_grad()
def evaluate(model: nn.Module, dataset, who: env.DistEnv, device: torch.device,
             batch_size: int = 256) -> tuple[float, float]:
    """Mean loss and accuracy over ``dataset``, each example counted exactly once across all ranks.

    ``DistributedSampler`` pads the index list to a multiple of W by repeating its first indices;
    rank r gets positions r, r+W, r+2W, ... of the padded list, and positions >= len(dataset) are
    the repeats, so they are masked out. The sums are then all-reduced.
    """
    model.eval()
    sampler = DistributedSampler(dataset, num_replicas=who.world_size, rank=who.rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    seen = 0
    for X, y in loader:
        X, y = X.to(device), y.to(device)
        position = who.rank + who.world_size * (seen + torch.arange(len(y), device=device))
        keep = position < len(dataset)
        seen += len(y)
        logits = model(X)
        loss = nn.functional.cross_entropy(logits, y, reduction="none")
        correct = (logits.argmax(1) == y)[keep]
        sums += torch.stack([t.double().sum() for t in (loss[keep], correct, keep)])
    if dist.is_initialized():
        dist.all_reduce(sums)  # SUM over ranks: every real example counted once
    model.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def train(args: argparse.Namespace) -> dict:
    # 1. Who am I? (torchrun, legacy launcher, SLURM or a plain process)
    who = env.detect(local_rank_arg=args.local_rank, expected_world_size=args.world_size)
    device, backend = choose_device(who, args.cpu)
    if args.batch_size % who.world_size:
        raise env.EnvError(f"--batch-size {args.batch_size} is the global batch and must divide evenly "
                           f"over {who.world_size} processes: use a multiple of {who.world_size}")
    if who.distributed:  # 2. Join the group; rank 0's host holds the rendezvous.
        dist.init_process_group(backend, init_method=who.init_method, rank=who.rank,
                                world_size=who.world_size, timeout=timedelta(seconds=args.timeout))
    log(who, f"{who.describe()}; {device.type}, backend {backend if who.distributed else '-'}")
    try:
        result = _fit(args, who, device)
        if who.distributed:
            dist.barrier()  # nobody leaves while others still talk
        return result
    finally:  # also after an error, without a barrier that the failed peers would never reach
        if dist.is_initialized():
            gc.collect()  # what still holds the group (DDP, a schedule) goes now, not at exit
            dist.destroy_process_group()


def _fit(args: argparse.Namespace, who: env.DistEnv, device: torch.device) -> dict:
    train_set, test_set = load_digits(size=28)
    if args.train_size is not None:
        train_set = Subset(train_set, range(min(args.train_size, len(train_set))))
    # 3. The same seed on every rank gives the same initial model (DDP would broadcast rank 0's anyway).
    model = lenet(seed=args.seed).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # 4. Resume: every rank loads the last checkpoint (weights_only, onto its own device) *before*
    #    wrapping in DDP, so model, optimizer and epoch agree everywhere.
    start, path = 0, None
    if args.ckpt_dir:
        path = f"{args.ckpt_dir}/last.pt"
        start, state = checkpoint.resume(path, model, optimizer, map_location=device)
        if state is not None:
            again = restart_count()
            log(who, f"resumed from {path} after epoch {start}"
                + (f" (torchrun restart {again})" if again else ""))

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) \
        if who.distributed else model
    sampler = DistributedSampler(train_set, num_replicas=who.world_size, rank=who.rank,
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size // who.world_size, sampler=sampler)
    history = []
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)  # 5. Without this, every epoch repeats epoch 0's order.
        tic, steps = time.perf_counter(), len(loader)
        total = torch.zeros((), device=device)  # summed on the device: no sync per step
        for step, (X, y) in enumerate(loader, 1):
            X, y = X.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(ddp(X), y)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            optimizer.step()
            total += loss.detach()
            progress(who, f"epoch {epoch + 1}/{args.epochs}", step, steps)
        if who.distributed:  # log the mean over all ranks, not rank 0's share alone
            dist.all_reduce(total)
        train_loss = total.item() / (steps * who.world_size)
        test_loss, test_acc = evaluate(model, test_set, who, device)
        history.append((epoch, train_loss, test_loss, test_acc))
        log(who, f"epoch {epoch + 1}: train loss {train_loss:.4f}, test loss {test_loss:.4f}, "
                 f"test accuracy {test_acc:.3f} ({time.perf_counter() - tic:.2f} s)")
        if path is not None:  # 6. Rank 0 saves model.module's weights; the others wait.
            if who.is_main:
                checkpoint.save(checkpoint.training_state(ddp, optimizer, epoch,
                                                          world_size=who.world_size), path)
            if who.distributed:
                dist.barrier()
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"state": state, "history": history, "start_epoch": start, "rank": who.rank,
            "world_size": who.world_size, "launcher": who.launcher}


def restart_count() -> int:
    """How many times torchrun has restarted this worker group (0 when not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def main(argv=None) -> dict:
    return train(parse_args(argv))


if __name__ == "__main__":
    try:
        main()
    except (env.EnvError, checkpoint.CheckpointError) as e:
        sys.exit(f"train_ddp.py: error: {e}")
