"""A small GPT on a 3D mesh with PyTorch's APIs: FSDP2 over dp, tensor parallelism over tp, a pipeline
over pp. torch only: no d2lpar.

``init_device_mesh(device, (dp, pp, tp))`` gives every rank three groups (tp innermost: neighbouring
ranks, one node's fast links). Rank (i, j, k) keeps pipeline stage j of the model
(``PipelineStage``, run by ``Schedule1F1B`` on m micro-batches); inside the stage, each transformer
block's four linear layers are cut over tp (``parallelize_module``: QKV and fc1 by columns, the
attention's output and fc2 by rows); ``fully_shard`` then shards each block, the embedding and the
head over dp, which also averages their gradients (a reduce-scatter per unit). ``--batch-size`` is
global: dp group i takes rows i B/dp .. (i+1) B/dp. Any layout ends with one process's weights, and
its first step's gradients (before AdamW, whose update ignores a constant gradient scale) equal
one process's.
On CPUs (gloo) or a GPU per process (NCCL), as is:

    python threed_torch.py                                                  # one process
    torchrun --standalone --nproc-per-node=8 threed_torch.py --dp 2 --tp 2 --pp 2 --out run

``--state FILE`` starts from a ``torch.save``'d {"model": state dict, "batches": [(X, Y), ...]}
instead of this file's seed and text (how a course checks it against its own runs); each batch is
cut into dp equal shares, so its rows must be a multiple of dp (of dp x micro-batches with a
pipeline, whose batches all have one shape), which is checked before anything starts.
"""

import argparse
import gc
import logging
import math
import os
import random
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


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


# ------------------------------------------------------------------------------------- the model

class Attention(nn.Module):
    """Causal self-attention; the QKV weight laid out head by head, so a block of rows is whole heads
    and a column split gives each tp rank its own heads (the width tells how many)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim, self.causal = d // heads, True
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1),
                                    float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln2, self.mlp = nn.LayerNorm(d), MLP(d, 4 * d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)

    def forward(self, tokens):
        return self.tok(tokens) + self.pos.weight[: tokens.shape[1]]


class Head(nn.Module):
    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x):
        return self.out(self.norm(x))


def gpt(vocab: int, seq: int, layers: int, d: int, heads: int) -> nn.Sequential:
    return nn.Sequential(Embed(vocab, d, seq), *[Block(d, heads) for _ in range(layers)], Head(d, vocab))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def text_batches(steps: int, batch: int, seq: int, seed: int):
    """Batches of a generated text (sentences from a tiny grammar), as character ids."""
    rng = random.Random(seed)
    words = (["the miller", "a sailor", "the baker"], ["carries", "finds", "mends"],
             ["a lantern", "the bread", "an old map"])
    text = "\n".join(" ".join(rng.choice(w) for w in words) + "." for _ in range(2000))
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, len(ids) - seq - 1, (batch,), generator=g).tolist()
        window = torch.stack([ids[s:s + seq + 1] for s in start])
        out.append((window[:, :-1], window[:, 1:]))
    return len(chars), out


# ------------------------------------------------------------------------------------ the layout

def stage_bounds(n: int, pp: int) -> list[tuple[int, int]]:
    """Consecutive near-equal slices of n layers, the first ones one longer."""
    q, r = divmod(n, pp)
    bounds, lo = [], 0
    for i in range(pp):
        hi = lo + q + (i < r)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def parallelize(stage: nn.Sequential, mesh) -> nn.Sequential:
    """Tensor parallelism over mesh["tp"] inside each block, then FSDP2 over mesh["dp"]."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    for layer in stage:
        if isinstance(layer, Block) and mesh["tp"].size() > 1:
            plan = {"attn.qkv": ColwiseParallel(), "attn.out": RowwiseParallel(),
                    "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
            parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])   # one unit per layer: gathered when it runs
    return fully_shard(stage, mesh=mesh["dp"])


def stage_io(model: nn.Sequential, lo: int, hi: int, rows: int, seq: int, device) -> tuple:
    """A micro-batch into and out of layers [lo, hi) (token ids into the embedding, (rows, seq, d)
    between layers, logits out of the head), for ``PipelineStage`` to take as given: otherwise the
    first step infers them by sending them between stages as pickled objects, which needs numpy."""
    d, vocab = model[0].tok.weight.shape[1], model[-1].out.out_features
    if lo == 0:
        into = torch.empty(rows, seq, dtype=torch.long, device=device)
    else:
        into = torch.empty(rows, seq, d, device=device, requires_grad=True)
    width = vocab if hi == len(model) else d
    return into, torch.empty(rows, seq, width, device=device, requires_grad=True)


def read_state(path: str) -> dict:
    """--state's file: {"model": a state dict of ``gpt``, "batches": [(X, Y), ...]}."""
    try:
        saved = torch.load(path)
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:80]
        raise Usage(f"cannot read --state {path} ({why}): give a file written by torch.save("
                    "{'model': state_dict, 'batches': [(X, Y), ...]})") from None
    if not isinstance(saved, dict) or not {"model", "batches"} <= set(saved):
        raise Usage(f"--state {path} holds no 'model' and 'batches': give a file written by "
                    "torch.save({'model': state_dict, 'batches': [(X, Y), ...]})")
    return saved


def check_batches(batches, dp: int, pp: int, microbatches: int) -> None:
    """Each batch cuts into dp equal shares (into dp x microbatches with a pipeline, whose stages are
    built for one micro-batch shape: every batch then has the first one's shape), so that the dp
    groups' mean losses and gradients average to the batch's."""
    if not batches:
        raise Usage("--state holds no batches: give a list of (X, Y) pairs")
    unit, first = dp * (microbatches if pp > 1 else 1), tuple(batches[0][0].shape)
    for i, (X, Y) in enumerate(batches):
        rows = X.shape[0]
        if X.shape != Y.shape:
            raise Usage(f"--state's batch {i} has inputs {tuple(X.shape)} but targets "
                        f"{tuple(Y.shape)}: give one target per token")
        if rows == 0 or rows % unit:
            raise Usage(f"--state's batch {i} has {rows} rows, not a multiple of --dp {dp}"
                        + (f" x --microbatches {microbatches}" if pp > 1 else "")
                        + ": each data-parallel group takes an equal share; change a degree, or "
                        "the batches")
        if pp > 1 and tuple(X.shape) != first:
            raise Usage(f"--state's batch {i} is {tuple(X.shape)} where batch 0 is {first}: the "
                        "pipeline's stages are built for one shape; give batches of one shape, "
                        "or use --pp 1")


def full_state(stage: nn.Module, lo: int, grads: bool = False) -> dict:
    """The stage's parameters (or their gradients), whole (DTensors gathered), under the full
    model's names."""
    # gathering a (dp, tp)-sharded weight takes two all-gathers; torch logs a warning saying so
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out = {}
    for name, p in stage.named_parameters():
        t = p.grad if grads else p
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        i, rest = name.split(".", 1)
        out[f"{lo + int(i)}.{rest}"] = t.detach().cpu().clone()
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="A GPT with FSDP2 x tensor x pipeline parallelism (torch only).")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=2, help="per step, per data-parallel group")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16, help="global batch, split over dp")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state", help="start from this file's model and batches")
    p.add_argument("--out", help="folder for each stage's final weights (stage<i>.pt)")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU even where there are GPUs")
    a = p.parse_args(argv)
    rank, world, local_rank = who_am_i()
    if a.dp * a.tp * a.pp != world:
        raise Usage(f"--dp {a.dp} x --tp {a.tp} x --pp {a.pp} = {a.dp * a.tp * a.pp}, but {world} "
                    f"process(es) run: start dp x tp x pp processes, or change the degrees")
    if a.d % a.heads or a.heads % a.tp or (4 * a.d) % a.tp:
        raise Usage(f"--tp {a.tp} must divide --heads {a.heads} (and --heads must divide --d {a.d})")
    if a.pp > a.layers + 2:
        raise Usage(f"--pp {a.pp} is more than the {a.layers + 2} layers (embedding, blocks, head)")
    if not a.state and a.batch_size % (a.dp * a.microbatches):   # --state's: check_batches
        raise Usage(f"--batch-size {a.batch_size} must be a multiple of --dp {a.dp} x --microbatches "
                    f"{a.microbatches} = {a.dp * a.microbatches}: each data-parallel group cuts its "
                    f"rows into equal micro-batches")
    try:  # fail now, not after training
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            tempfile.TemporaryFile(dir=a.out).close()
    except OSError as e:
        raise Usage(f"cannot write to --out {a.out} ({e.strerror}): give a folder you can write")
    saved = read_state(a.state) if a.state else None
    if saved is not None:
        check_batches(saved["batches"], a.dp, a.pp, a.microbatches)
    if not a.cpu and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world)
    for said in ("FSDP2-wrapped module", "torch.distributed is disabled"):
        warnings.filterwarnings("ignore", message=said)
    try:
        return train(a, rank, world, device, saved)
    finally:  # also after an error, so that no rank waits for a dead group
        if dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()


def train(a, rank: int, world: int, device: torch.device, saved: dict | None = None) -> dict:
    if saved is not None:
        batches = saved["batches"]
        d, vocab = saved["model"]["0.tok.weight"].shape[1], saved["model"]["0.tok.weight"].shape[0]
        model = gpt(vocab, saved["model"]["0.pos.weight"].shape[0], a.layers, d, a.heads)
        model.load_state_dict(saved["model"])
    else:
        vocab, batches = text_batches(a.steps, a.batch_size, a.seq, a.seed)
        torch.manual_seed(a.seed)   # the same full model on every rank, before it is cut
        model = gpt(vocab, a.seq, a.layers, a.d, a.heads)
    lo, hi, row, stage_index, mesh = 0, len(model), 0, 0, None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (a.dp, a.pp, a.tp), mesh_dim_names=("dp", "pp", "tp"))
        row, stage_index = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
        lo, hi = stage_bounds(len(model), a.pp)[stage_index]
    stage = nn.Sequential(*list(model)[lo:hi]).to(device)
    if mesh is not None:
        stage = parallelize(stage, mesh)
    opt = torch.optim.AdamW(stage.parameters(), lr=a.lr)
    schedule = None
    if a.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        rows, seq = batches[0][0].shape   # every batch's (check_batches)
        into, out = stage_io(model, lo, hi, rows // (a.dp * a.microbatches), seq, device)
        pipe = PipelineStage(stage, stage_index, a.pp, device, input_args=into, output_args=out,
                             group=mesh["pp"].get_group())
        schedule = Schedule1F1B(pipe, a.microbatches, loss_fn=loss_fn)   # grads of the batch's mean loss
    losses, seconds, grads = [], [], None
    for X, Y in batches:
        per = X.shape[0] // a.dp   # this batch's share: equal, so the dp groups' means average right
        X, Y = X[row * per:(row + 1) * per].to(device), Y[row * per:(row + 1) * per].to(device)
        if world > 1:
            dist.barrier()   # every rank starts the step together
        t0 = time.perf_counter()
        opt.zero_grad()
        if schedule is None:
            loss = loss_fn(stage(X), Y)
            loss.backward()
            losses.append(loss.detach())
        elif stage_index == 0:
            schedule.step(X)
        elif stage_index == a.pp - 1:
            mb = []
            schedule.step(target=Y, losses=mb)
            losses.append(torch.stack(mb).mean().detach())
        else:
            schedule.step()
        t1 = time.perf_counter()
        if grads is None:   # the first step's gradients, before AdamW (which hides a constant scale)
            grads = full_state(stage, lo, grads=True)
        t2 = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - t0 - (t2 - t1))   # the gathering not counted
    last = stage_index == a.pp - 1
    if losses and a.dp > 1:   # the global batch's loss: the mean of the dp groups'
        losses = torch.stack(losses)
        dist.all_reduce(losses, group=mesh["dp"].get_group())
        losses = list(losses / a.dp)
    state = full_state(stage, lo)
    if a.out and (mesh is None or (row == 0 and mesh.get_local_rank("tp") == 0)):
        os.makedirs(a.out, exist_ok=True)
        torch.save(state, os.path.join(a.out, f"stage{stage_index}.pt"))
    if last and rank == world - 1:
        print(f"dp {a.dp} x tp {a.tp} x pp {a.pp} on {device}: losses "
              + " ".join(f"{float(v):.4f}" for v in losses), flush=True)
    return {"stage": stage_index, "losses": [float(v) for v in losses] if last else [], "state": state,
            "grads": grads, "seconds": seconds}


if __name__ == "__main__":
    try:
        main()
    except Usage as e:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {e}")
