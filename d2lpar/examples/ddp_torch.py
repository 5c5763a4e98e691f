r"""DistributedDataParallel training in one file, torch only: copy it into a project and edit it.

torch only: no d2lpar. Synthetic data from a fixed seed (runs compare weight for weight): put your
own data and model in ``make_data_and_model``. On CPUs (gloo) or a GPU per process (NCCL), as is:

    python ddp_torch.py --out ckpt                                    # one plain process
    torchrun --standalone --nproc-per-node=2 ddp_torch.py --out ckpt  # one node, 2 processes
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2 --nproc-per-node=8 \
        --rdzv-backend=c10d --rdzv-endpoint=HOST0:29400 --rdzv-id=job42 --max-restarts=3 \
        ddp_torch.py --out ckpt                                       # the same line on every node
    MASTER_ADDR=HOST0 MASTER_PORT=29500 srun --ntasks-per-node=8 --gpus-per-task=1 \
        python ddp_torch.py --out ckpt                                # one task per GPU

(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch 2.14.1, restarted workers could otherwise read
the dead workers' addresses from a shared store and fail or hang; pytorch/pytorch#135712.)
--out must be one folder that every node sees: every rank resumes from the same last.pt, and
ranks that find different epochs there stop with one sentence.

The device (``choose_device``, then ``check_one_gpu_each``): a process that sees exactly one GPU
uses cuda:0, its own (srun --gpus-per-task=1, torchrun --virtual-local-rank, a per-process
CUDA_VISIBLE_DEVICES); one that sees all of its node's GPUs (torchrun, srun without binding) takes
cuda:LOCAL_RANK when there are as many GPUs as processes on the node, and stops with one sentence
when there are fewer. Right after init the ranks exchange their GPUs' UUIDs over gloo, before
NCCL connects: two ranks on one GPU (what NCCL refuses, e.g. two torchrun workers on a one-GPU
node) stop every rank with one sentence. Without CUDA, or with ``--cpu``, gloo on the CPU. Rank 0
says which.

The path: environment -> set_device -> init_process_group -> one GPU each -> DDP ->
DistributedSampler with set_epoch -> rank 0 saves model.module -> barrier -> destroy_process_group.
``--batch-size`` is the global batch: W ranks take B/W each, DDP averages their gradients, so W
ranks end with one process's weights (to rounding) when every batch is full and the sampler pads
nothing. Every rank resumes from the last epoch's checkpoint (``--max-restarts``). Any sentence this
script stops with (a bad option, a shared GPU, different epochs) is a failed worker to torchrun:
with --max-restarts=3 it restarts the group 3 times and the same sentence comes back each time.
"""

import argparse
import gc
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Usage(Exception):  # bad input: printed as one sentence, without a traceback
    pass


def who_am_i() -> tuple[int, int, int]:
    """(rank, world size, local rank): torchrun's variables, else SLURM's, else one process."""
    env = os.environ
    if "RANK" in env or "WORLD_SIZE" in env:  # torchrun and the legacy launcher
        names = ["RANK", "WORLD_SIZE", "LOCAL_RANK"]
    elif "SLURM_PROCID" in env:  # srun: one task per process
        names = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"]
    else:
        return 0, 1, 0
    if int(env.get(names[1], 2)) > 1:  # more than one process: they must meet at rank 0's host
        names += ["MASTER_ADDR", "MASTER_PORT"]
    if missing := [name for name in names if not env.get(name)]:
        raise Usage(f"{', '.join(missing)} not set: start with torchrun, or set them in the job "
                    f"script (MASTER_ADDR: rank 0's host, MASTER_PORT: a free port)")
    return int(env[names[0]]), int(env[names[1]]), int(env[names[2]])


def per_node() -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, else this node's entry of SLURM's
    SLURM_TASKS_PER_NODE (it reads like "8(x2),3": 8 on nodes 0 and 1, 3 on node 2), else 1."""
    env = os.environ
    if env.get("LOCAL_WORLD_SIZE"):
        return int(env["LOCAL_WORLD_SIZE"])
    if env.get("SLURM_TASKS_PER_NODE"):
        counts = []
        for part in env["SLURM_TASKS_PER_NODE"].split(","):
            n, _, times = part.partition("(x")
            counts += [int(n)] * int(times.rstrip(")") or 1)
        return counts[int(env.get("SLURM_NODEID", 0))]
    return 1


def choose_device(local_rank: int, local_world: int, visible: int,
                  cpu: bool = False) -> tuple[torch.device, str, str]:
    """(device, backend, why) for a process that sees ``visible`` GPUs, with ``local_world``
    processes on its node. One GPU visible: cuda:0, its own (if others see the same one,
    ``check_one_gpu_each`` stops the job after init). Several: cuda:LOCAL_RANK when there is one
    for each process on the node, else a Usage error (two ranks on one GPU is what NCCL refuses)."""
    if cpu:
        return torch.device("cpu"), "gloo", "--cpu given: gloo on the CPU"
    if visible == 0:
        return torch.device("cpu"), "gloo", "no CUDA GPU visible: gloo on the CPU"
    if visible == 1:
        return torch.device("cuda", 0), "nccl", "one GPU visible to this process: cuda:0, NCCL"
    if visible >= local_world and local_rank < visible:
        return (torch.device("cuda", local_rank), "nccl",
                f"{visible} GPUs visible, {local_world} processes here: cuda:LOCAL_RANK, NCCL")
    raise Usage(f"this process sees {visible} GPU(s) but {local_world} processes run on this node: "
                f"bind one GPU per process (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES), "
                f"start at most {visible} per node, or pass --cpu")


def shared_gpus(uuids: list[str]) -> str | None:
    """One sentence naming the ranks that share a GPU, or None when every rank has its own."""
    first: dict[str, int] = {}
    for rank, uuid in enumerate(uuids):
        if uuid in first:
            return (f"ranks {first[uuid]} and {rank} were given the same GPU ({uuid}): start one "
                    f"process per GPU (srun --gpus-per-task=1, torchrun --nproc-per-node at most "
                    f"the node's GPUs), or pass --cpu")
        first[uuid] = rank
    return None


def check_one_gpu_each(device: torch.device, world: int) -> None:
    """Every rank gathers every rank's GPU UUID over a gloo group, before NCCL connects (NCCL would
    fail on a shared GPU with its own error), and all stop with the same sentence on a repeat."""
    if device.type != "cuda" or world == 1:
        return
    # as 64 bytes in a tensor, not all_gather_object: torch unpickles a received object with numpy
    mine = str(torch.cuda.get_device_properties(device).uuid).encode()[:64].ljust(64, b"\0")
    gathered = [torch.zeros(64, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor(list(mine), dtype=torch.uint8),
                    group=dist.new_group(backend="gloo"))
    uuids = [bytes(t.tolist()).rstrip(b"\0").decode() for t in gathered]
    if problem := shared_gpus(uuids):
        raise Usage(problem)


def make_data_and_model(n: int, seed: int) -> tuple[TensorDataset, nn.Module]:
    """n examples of 16 features, the class is the argmax of a fixed random map; a small MLP."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 16, generator=g)
    torch.manual_seed(seed)  # the same start on every rank (DDP also broadcasts rank 0's weights)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    return TensorDataset(X, (X @ torch.randn(16, 4, generator=g)).argmax(1)), model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Minimal DDP training (torch only).")
    p.add_argument("--out", required=True, help="folder for last.pt, visible to every node")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="global batch, split over the ranks")
    p.add_argument("--examples", type=int, default=1024, help="size of the data set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU even where GPUs are visible")
    p.add_argument("--local-rank", "--local_rank", help=argparse.SUPPRESS)  # legacy: LOCAL_RANK
    args = p.parse_args(argv)
    rank, world, local_rank = who_am_i()
    if args.batch_size % world:
        raise Usage(f"--batch-size {args.batch_size} is the global batch and does not divide over "
                    f"{world} processes: use a multiple of {world}")
    try:  # fail now, not after an epoch of training
        os.makedirs(args.out, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as e:
        raise Usage(f"cannot write to --out {args.out} ({e.strerror}): give a folder you can write")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device, backend, why = choose_device(local_rank, per_node(), visible, args.cpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if rank == 0:
        print(f"rank 0 of {world}: {why}", flush=True)
    if world > 1:  # rank and world_size go together; env:// reads MASTER_ADDR and MASTER_PORT
        # timeout: torch's default (10 min with NCCL, 30 with gloo). It bounds every collective,
        # not only the start: a rank-0 save longer than it, while the others wait in the barrier,
        # kills the job; pass a longer timedelta for large models on a slow file system.
        # No device_id=: it would connect NCCL inside this call, before the GPU check below.
        dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        check_one_gpu_each(device, world)
        train(args, rank, world, device)
        if world > 1:
            dist.barrier(**barrier_device(device))  # all done before any rank disconnects
    finally:  # also after an error, so that no rank waits for a dead group
        if dist.is_initialized():
            gc.collect()  # what still holds the group (DDP, a schedule) goes now, not at exit
            dist.destroy_process_group()


def train(args, rank: int, world: int, device: torch.device) -> None:
    data, net = make_data_and_model(args.examples, args.seed)
    net = net.to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    path, start = os.path.join(args.out, "last.pt"), 0
    if os.path.exists(path):  # resume on every rank, before DDP, onto this rank's device
        state = torch.load(path, map_location=device, weights_only=True)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
        if rank == 0:
            print(f"rank 0: resumed after epoch {start} from {path}", flush=True)
    if world > 1:  # every rank must resume from the same epoch, or they deadlock later
        first_last = torch.tensor([start, -start], device=device)
        dist.all_reduce(first_last, op=dist.ReduceOp.MAX)  # the latest and (minus) the earliest
        if first_last[0].item() != -first_last[1].item():
            raise Usage(f"the ranks found checkpoints of different epochs in --out {args.out} "
                        f"(this rank: {start} epoch(s) done): give a folder that "
                        f"every node sees, or an empty one")
    ids = [device.index] if device.type == "cuda" else None  # the one GPU of this process
    model = DDP(net, device_ids=ids) if world > 1 else net  # DDP whenever world > 1, GPUs or not
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size // world, sampler=sampler)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        total = torch.zeros((), device=device)
        for X, y in loader:
            loss = nn.functional.cross_entropy(model(X.to(device)), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over the ranks here
            optimizer.step()
            total += loss.detach()
        if world > 1:
            dist.all_reduce(total)  # the mean loss over all ranks, not rank 0's share
        if rank == 0:
            print(f"rank 0 of {world} ({device}): epoch {epoch + 1}, mean loss "
                  f"{total.item() / (len(loader) * world):.4f}", flush=True)
            plain = model.module if world > 1 else model  # names without DDP's "module." prefix
            save_atomically({"model": plain.state_dict(), "optimizer": optimizer.state_dict(),
                             "epoch": epoch}, path)
        if world > 1:
            dist.barrier(**barrier_device(device))  # nobody goes on before the file is complete


def barrier_device(device: torch.device) -> dict:
    """NCCL's barrier is an all-reduce on a GPU: name this rank's (gloo's needs none)."""
    return {"device_ids": [device.index]} if device.type == "cuda" else {}


def save_atomically(state: dict, path: str) -> None:
    """A crash at any moment leaves the old file or the new one, never a half-written one."""
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the name points at them
    os.replace(path + ".tmp", path)  # atomic on POSIX file systems
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(folder)  # and the rename itself survives a power cut
    finally:
        os.close(folder)


@record  # under torchrun: an unexpected error's traceback goes into torchrun's failure summary
def cli() -> None:
    try:
        main()
    except Usage as e:  # one sentence, exit status 1 (a SystemExit, which @record passes on)
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {e}")


if __name__ == "__main__":
    cli()
