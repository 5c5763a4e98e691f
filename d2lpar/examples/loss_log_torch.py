r"""Log every step's loss and gradient norm in a parallel trainer; compare two runs' logs against a
noise band, in one command. torch only.

torch only: no d2lpar, and no numpy needed (nothing travels between ranks as a pickled object).
Add three lines to any trainer:

    log = LossLog("run.jsonl")                          # rank 0 appends one JSON line per step
    ...after loss.backward(), before optimizer.step():
    log.step(step, loss_sum, tokens, model)

``loss_sum`` is this rank's summed cross-entropy over its real (not padding) tokens and ``tokens``
their number: the log holds sum(loss_sum) / sum(tokens) over the ranks that read different data
(``group=``, default every rank; under tensor parallelism give the data-parallel group, as
``--layout tp`` does), the loss of the whole global batch whatever the layout, and the norm of the
gradient the optimizer is about to apply: ``torch.nn.utils.get_total_norm`` of the DTensor
gradients (FSDP2's shards, tensor parallelism's), reduced over their mesh with ``full_tensor()``,
and of the plain ones (DDP's, or the layers tensor parallelism leaves whole: the same on every
rank), kept apart because torch cannot stack the norms of the two kinds together. Then compare two
layouts' logs:

    python loss_log_torch.py compare ddp.jsonl fsdp.jsonl --noise one.jsonl one_reordered.jsonl

It prints "within the band" or "outside the band from step k (loss or grad_norm)": the band at
step k is --factor times the largest difference so far between two runs that differ by numerics
only (--noise: the same training with its sums in another order), and never less than --factor
fp32 rounding units of the value; and how far apart the noise runs were, in rounding units (about
one, for short runs in fp32: the band is then the floor, and a bug is thousands of units away). The
band holds for this model, learning rate, optimizer and number of steps only: measure it again when
one of them changes. A small trainer to try it, on CPUs (gloo) or a GPU per process:

    python loss_log_torch.py train --out one.jsonl
    python loss_log_torch.py train --out one_reordered.jsonl --accumulate 4
    torchrun --standalone --nproc-per-node=2 loss_log_torch.py train --layout ddp --out ddp.jsonl
    torchrun --standalone --nproc-per-node=2 loss_log_torch.py train --layout fsdp --out fsdp.jsonl
    torchrun --standalone --nproc-per-node=2 loss_log_torch.py train --layout tp --out tp.jsonl
    python loss_log_torch.py compare ddp.jsonl fsdp.jsonl --noise one.jsonl one_reordered.jsonl

Its model reads padded sequences of different lengths; each rank's loss is its summed
cross-entropy divided by the real tokens of the whole global batch, times the ranks DDP and FSDP2
average over (torchtitan's normalisation). ``--layout tp`` cuts its two Linear layers with
``parallelize_module`` (column-wise, then row-wise) over every rank, each reading the whole batch.
``--bug rank-mean`` plants the classic error (each rank's own token mean): compare its log with one
process's and it leaves the band at step 1. With dropout in a model, compare with the dropout off
(p = 0), unless every layout draws each mask where one process would.
"""

import argparse
import gc
import json
import math
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

IGNORE = -100   # padding targets: F.cross_entropy(..., ignore_index=IGNORE) skips them
EPS32 = torch.finfo(torch.float32).eps


class Usage(Exception):  # bad input: printed as one sentence, without a traceback
    pass


# --------------------------------------------------------------- the lines to add to a trainer

class LossLog:
    """Rank 0 appends {"step", "loss", "tokens", "grad_norm"} to ``path``: a JSON line per step."""

    def __init__(self, path: str, group=None):
        self.path, self.group = path, group
        self.writer = not dist.is_initialized() or dist.get_rank() == 0
        if self.writer:
            open(path, "w").close()   # a fresh log per run

    def step(self, step: int, loss_sum, tokens, model: nn.Module) -> dict:
        device = next(model.parameters()).device
        sums = torch.tensor([float(loss_sum), float(tokens)], dtype=torch.float64, device=device)
        if dist.is_initialized():
            dist.all_reduce(sums, group=self.group)   # a tensor collective: no pickling
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        squares = 0.0
        for dtensor in (True, False):   # torch's foreach norm refuses DTensors mixed with tensors
            kind = [g for g in grads if hasattr(g, "full_tensor") == dtensor]
            if kind:
                norm = torch.nn.utils.get_total_norm(kind)
                norm = norm.full_tensor() if dtensor else norm   # reduced over the DTensors' mesh
                squares += float(norm) ** 2
        record = {"step": step, "loss": sums[0].item() / sums[1].item(),
                  "tokens": int(sums[1].item()), "grad_norm": math.sqrt(squares)}
        if self.writer:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record


# ------------------------------------------------------------------------------- the comparison

def read_log(path: str) -> list[dict]:
    try:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise Usage(f"cannot read {path} ({e.strerror}): give a log written by LossLog")
    except json.JSONDecodeError:
        raise Usage(f"{path} is not a log of JSON lines: give a log written by LossLog")
    if not records or any(set(r) < {"step", "loss", "grad_norm"} for r in records):
        raise Usage(f"{path} holds no steps with a loss and a grad_norm: give a log written by "
                    f"LossLog")
    return records


def band_of(noise_a: list[dict], noise_b: list[dict], factor: float, key: str) -> list[float]:
    """Per step: factor x the largest |a - b| so far, at least factor fp32 rounding units."""
    out, spread = [], 0.0
    for a, b in zip(noise_a, noise_b):
        spread = max(spread, abs(a[key] - b[key]))
        out.append(factor * max(spread, EPS32 * abs(a[key])))
    return out


def noise_units(noise_a: list[dict], noise_b: list[dict], key: str) -> float:
    """The largest difference between the two noise runs, in fp32 rounding units of the value."""
    return max(abs(a[key] - b[key]) / (EPS32 * abs(a[key]) or 1.0) for a, b in zip(noise_a, noise_b))


def compare(a: list[dict], b: list[dict], noise: tuple, factor: float = 4.0) -> str:
    """"within the band", or "outside the band from step k (what)", for logs ``a`` and ``b``."""
    steps = min(len(a), len(b), len(noise[0]), len(noise[1]))
    bands = {k: band_of(noise[0], noise[1], factor, k) for k in ("loss", "grad_norm")}
    for i in range(steps):
        for key in ("loss", "grad_norm"):
            if not abs(a[i][key] - b[i][key]) <= bands[key][i]:   # NaN is outside too
                return f"outside the band from step {a[i]['step']} ({key})"
    return f"within the band ({steps} steps)"


# ------------------------------------------------------------------------- a trainer to try it on

def make_data(steps: int, batch: int, seq: int, vocab: int, seed: int = 0) -> list:
    """Padded rows of different lengths; each next token is (3 x + 1) mod vocab, or random (1/4)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        X = torch.zeros(batch, seq, dtype=torch.long)
        Y = torch.full((batch, seq), IGNORE, dtype=torch.long)
        for r in range(batch):
            n = int(torch.randint(2, seq + 1, (1,), generator=g))
            t = torch.randint(0, vocab, (n + 1,), generator=g)
            for i in range(1, n + 1):
                if torch.rand(1, generator=g) > 0.25:
                    t[i] = (3 * t[i - 1] + 1) % vocab
            X[r, :n], Y[r, :n] = t[:-1], t[1:]
        out.append((X, Y))
    return out


def make_model(vocab: int, d: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)   # the same weights on every rank
    return nn.Sequential(nn.Embedding(vocab, d), nn.Linear(d, 4 * d), nn.GELU(),
                         nn.Linear(4 * d, vocab))


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


def train(args, rank: int, world: int, device: torch.device) -> list[dict]:
    data = make_data(args.steps, args.batch_size, args.seq, args.vocab)
    model = make_model(args.vocab, args.d).to(device)
    group, dp, dp_rank = None, world, rank   # LossLog sums over the ranks reading different rows
    if args.layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif args.layout == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif args.layout == "tp":   # every rank a tensor rank: one data-parallel rank, the whole batch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh(device.type, (1, world), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
        group, dp, dp_rank = mesh["dp"].get_group(), 1, 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    log = LossLog(args.out, group)
    per = args.batch_size // dp
    records = []
    for step, (X, Y) in enumerate(data, 1):
        rows = slice(dp_rank * per, (dp_rank + 1) * per)
        X, Y = X[rows].to(device), Y[rows].to(device)
        everyone = int((data[step - 1][1] != IGNORE).sum())   # real tokens of the global batch
        optimizer.zero_grad(set_to_none=True)
        loss_sum, tokens = 0.0, 0
        parts = torch.arange(len(X)).chunk(args.accumulate)[::-1]   # another order: last part first
        for rows in parts:
            logits = model(X[rows])
            total = F.cross_entropy(logits.flatten(0, 1), Y[rows].flatten(), ignore_index=IGNORE,
                                    reduction="sum")
            mine = int((Y[rows] != IGNORE).sum())
            if args.bug == "rank-mean":   # each rank's own mean: its tokens weigh by its count
                loss = total / int((Y != IGNORE).sum()) / len(parts)
            else:                         # every token 1/N; x dp: DDP and FSDP2 average
                loss = total / everyone * dp
            loss.backward()
            loss_sum, tokens = loss_sum + total.item(), tokens + mine
        records.append(log.step(step, loss_sum, tokens, model))
        optimizer.step()
        if rank == 0 and (step == args.steps or step % 10 == 0):
            print(f"rank 0 of {world} ({args.layout}, {device}): step {step}, loss "
                  f"{records[-1]['loss']:.6f}", flush=True)
    return records


def main(argv=None):
    p = argparse.ArgumentParser(description="Per-step losses of a parallel trainer, compared.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the small model and log its steps")
    t.add_argument("--layout", choices=["single", "ddp", "fsdp", "tp"], default="single")
    t.add_argument("--out", required=True, help="the log: one JSON line per step")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--batch-size", type=int, default=8, help="the global batch, in rows")
    t.add_argument("--seq", type=int, default=16)
    t.add_argument("--vocab", type=int, default=32)
    t.add_argument("--d", type=int, default=32)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--accumulate", type=int, default=1, help="micro-batches per rank and step")
    t.add_argument("--bug", choices=["none", "rank-mean"], default="none")
    c = sub.add_parser("compare", help="two logs against the band of two noise logs")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--noise", nargs=2, required=True, metavar=("RUN", "REORDERED"))
    c.add_argument("--factor", type=float, default=4.0)
    args = p.parse_args(None if argv is None else [str(a) for a in argv])
    if args.command == "compare":
        if not 0 < args.factor < math.inf:
            raise Usage(f"--factor {args.factor}: give a positive number (4 is the default)")
        logs = [read_log(path) for path in (args.a, args.b, *args.noise)]
        verdict = compare(logs[0], logs[1], (logs[2], logs[3]), args.factor)
        print(f"{os.path.basename(args.a)} against {os.path.basename(args.b)}: {verdict}")
        units = {k: noise_units(logs[2], logs[3], k) for k in ("loss", "grad_norm")}
        print(f"  noise: at most {units['loss']:.2f} (loss), {units['grad_norm']:.2f} (grad_norm) "
              f"fp32 rounding units apart; band: {args.factor:g} x max(that, 1)")
        return verdict
    for name in ("steps", "batch_size", "seq", "vocab", "d", "accumulate"):
        if getattr(args, name) < 1:
            raise Usage(f"--{name.replace('_', '-')} {getattr(args, name)}: give at least 1")
    rank, world, local_rank = who_am_i()
    if args.layout == "single" and world > 1:
        raise Usage(f"--layout single runs in one process, not {world}: choose ddp, fsdp or tp")
    if args.layout != "single" and world == 1:
        raise Usage(f"--layout {args.layout} needs ranks: start it with torchrun "
                    f"--nproc-per-node=2 or more")
    if args.layout == "tp" and (4 * args.d) % world:
        raise Usage(f"--layout tp cuts the {4 * args.d} hidden features over {world} ranks: give a "
                    f"--d whose 4 x d is a multiple of {world}")
    dp = 1 if args.layout == "tp" else world
    if args.batch_size % dp or args.batch_size // dp < args.accumulate:
        raise Usage(f"--batch-size {args.batch_size} does not give each of {dp} data-parallel "
                    f"rank(s) {args.accumulate} row(s) or more in equal shares: use a multiple of "
                    f"{dp * args.accumulate}")
    gpus = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = torch.device("cuda", local_rank) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    if world > 1:  # env:// reads MASTER_ADDR and MASTER_PORT
        dist.init_process_group("nccl" if gpus else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(minutes=2))
    try:
        return train(args, rank, world, device)
    finally:  # also after an error, so that no rank waits for a dead group
        if dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Usage as e:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {e}")
