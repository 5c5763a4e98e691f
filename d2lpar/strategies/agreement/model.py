"""A character GPT with dropout, padded sequences of different lengths, and randomness by position.

Three things make a real trainer's loss curve depend on its layout, and this GPT has all three:

* **dropout**, after the embedding, after attention, inside the MLP (after GELU: under tensor
  parallelism these features are split over the ranks) and after the MLP;
* **sequences of different lengths**, padded to ``seq``; the padding's targets are ``IGNORE`` and
  the loss is the mean over the real tokens of the *global* batch: sum of cross-entropies / N, where
  N counts the real tokens of every row of every rank (torchtitan's ``global_valid_tokens``);
* **random initial weights**.

**Randomness by position.** Every random tensor (a weight at initialisation, a dropout mask at a
step) is described by a ``Draw``: what it is, the step, the shape it has on one device, the part of
it this rank holds (``index``, a slice per dimension), whether the tensor-parallel neighbours hold
other parts (``sharded``) and the rank's coordinates. A *rule* turns a Draw into uniform numbers in
[0, 1) of the local shape (``rules.py``). The rule that keeps a layout equal to one device draws
the whole tensor from a generator keyed by (seed, what, step) and keeps the rank's part: the mask
of a token then depends on where it sits in the global batch, never on which rank computes it.
DTensor's random ops promise less (``OffsetBasedRNGTracker``, ``torch/distributed/tensor/_random.py``
in torch 2.14): ranks holding the same shard (replicas) draw equal numbers, and different shards
draw from separate parts of one Philox stream (each shard starts at its linear index x the local
numel; every rank then skips the whole tensor's numbers); it does not promise one device's numbers
("does not consider DTensor's contiguity": a ``Shard(-1)`` tensor's columns are not one device's),
and it refuses CPU devices. The layouts tell the modules where their tensors sit with ``at(...)``:
the step, the rows (offset in the global batch) and the token positions a rank holds.

``Block`` is pre-LayerNorm attention + MLP; its QKV weight is laid out head by head (q, k, v of
head 0, then of head 1, ...), as ``tensor.blocks``, so a block of rows is a set of whole heads.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from d2lpar.infra.text import CharCorpus
from d2lpar.strategies.tensor.blocks import attention

__all__ = ["IGNORE", "Config", "Draw", "key_of", "at", "now", "dropout", "Linear", "Embed", "Block",
           "Head", "build", "init_weights", "token_loss", "variable_batches", "param_slices"]

IGNORE = -100   # the target of a padding position: F.cross_entropy's ignore_index


@dataclass(frozen=True)
class Config:
    """The GPT's sizes; ``p`` is the dropout probability; ``seed`` keys every random draw."""
    vocab: int
    seq: int = 32
    layers: int = 2
    d: int = 32
    heads: int = 4
    hidden: int = 64
    p: float = 0.1
    seed: int = 0

    def check(self) -> None:
        for name in ("vocab", "seq", "layers", "d", "heads", "hidden"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name}={v!r}: give a positive whole number")
        if self.d % self.heads:
            raise ValueError(f"d={self.d} does not split into heads={self.heads}: make d a "
                             f"multiple of the heads")
        if not 0 <= self.p < 1:
            raise ValueError(f"p={self.p!r}: a dropout probability is in [0, 1)")


@dataclass(frozen=True)
class Draw:
    """One random tensor, as a rule sees it (see the module docstring)."""
    what: str            # "init 1.fc1.weight", "dropout 1.hidden"
    step: int            # 0 at initialisation, k for step k's masks
    shape: tuple         # its shape on one device
    index: tuple         # this rank's part: one slice per dimension
    sharded: bool        # do this rank's tensor-parallel neighbours hold other parts of it (other
                         # features, or under sequence parallelism other positions)?
    coords: dict         # this rank's coordinates: dp, tp, pp, cp
    seed: int = 0

    @property
    def local_shape(self) -> tuple:
        return tuple(len(range(*s.indices(n))) for s, n in zip(self.index, self.shape))


def key_of(seed: int, what: str, step: int) -> int:
    """A generator seed for (seed, what, step): the same on every machine (crc32, not hash())."""
    return zlib.crc32(f"{seed}|{what}|{step}".encode())


# ------------------------------------------------------------------ where this rank's tensors sit

@dataclass
class _Now:
    step: int = 0
    rows: tuple = (0, 1)          # (this rank's first row in the global batch, the global rows)
    seq: tuple = (0, 1)           # (offset of this rank's first position, global positions)
    coords: dict = field(default_factory=lambda: {"dp": 0, "tp": 0, "pp": 0, "cp": 0})
    rule: object = None           # the dropout rule (rules.one_device, unless a layout plants one)
    seed: int = 0
    p: float = 0.0
    linear: str = "plain"         # one device only: "split", "quarters" (other orders), "fp32"


_NOW = _Now()


def now() -> _Now:
    return _NOW


@contextlib.contextmanager
def at(**changes):
    """Set where this rank's tensors sit (step, rows, seq, coords, rule, seed, p, dtype) for a block
    of code; the previous values come back after it."""
    global _NOW
    before = _NOW
    _NOW = replace(_NOW, **changes)
    try:
        yield _NOW
    finally:
        _NOW = before


def dropout(x: torch.Tensor, site: str, seq: tuple | None = None,
            feature: tuple | None = None) -> torch.Tensor:
    """Dropout of ``x`` (b, s, f) at ``site``, its mask drawn by the current rule at the global
    position of every element: rows from ``at``; positions ``seq`` = (offset, total), given when the
    tensor-parallel neighbours hold the other positions (sequence parallelism; default: the rank's
    positions from ``at``, which under context parallelism are its own too); features ``feature`` =
    (offset, total), given when the neighbours hold the other features (default: all). The Draw is
    ``sharded`` when either is given."""
    n = _NOW
    if n.p == 0 or not torch.is_grad_enabled():
        return x
    b, s, f = x.shape
    (r0, R), (s0, S) = n.rows, seq or n.seq
    f0, Fg = feature or (0, f)
    d = Draw(f"dropout {site}", n.step, (R, S, Fg),
             (slice(r0, r0 + b), slice(s0, s0 + s), slice(f0, f0 + f)),
             feature is not None or seq is not None, n.coords, n.seed)
    u = n.rule(d)
    if tuple(u.shape) != (b, s, f):
        raise ValueError(f"the dropout rule returned shape {tuple(u.shape)} for {d.what}, whose "
                         f"part here is {(b, s, f)}: a rule returns uniforms of the local shape")
    keep = (u >= n.p).to(x.dtype)
    return x * keep / (1 - n.p)


# ------------------------------------------------------------------------------------ the model

class Linear(nn.Linear):
    """nn.Linear; on one device it can also sum its products in other orders, the runs that measure
    the noise band: ``at(linear="split")``, the two halves of the input features, the second half
    first (as a row-parallel layer's two ranks add their partial sums); ``"quarters"``, four
    quarters, the last first, the bias last. ``"fp32"``, under bf16 autocast: the same bf16-rounded
    inputs and weights (their products are exact in fp32), summed in fp32, with the output and the
    bias kept in fp32 where autocast's bf16 matmul rounds its output (and the bias) to bf16."""

    def forward(self, x):
        how = _NOW.linear
        if how == "split":
            h = self.in_features // 2
            return (F.linear(x[..., h:], self.weight[:, h:])
                    + F.linear(x[..., :h], self.weight[:, :h], self.bias))
        if how == "quarters":
            n = self.in_features
            cuts = [(k * n // 4, (k + 1) * n // 4) for k in (3, 2, 1, 0)]
            out = sum(F.linear(x[..., a:b], self.weight[:, a:b]) for a, b in cuts)
            return out if self.bias is None else out + self.bias
        if how == "fp32" and torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                bf = torch.bfloat16
                return F.linear(x.to(bf).float(), self.weight.to(bf).float(), self.bias)
        return super().forward(x)


class Embed(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tok, self.pos = nn.Embedding(cfg.vocab, cfg.d), nn.Embedding(cfg.seq, cfg.d)

    def forward(self, tokens):
        s0, _ = _NOW.seq       # context parallelism: this rank's positions start at s0
        return dropout(self.tok(tokens) + self.pos.weight[s0:s0 + tokens.shape[1]], "embed")


class Block(nn.Module):
    """x + drop(attn(ln1 x)), then + drop(fc2(drop(gelu(fc1(ln2 .))))): causal self-attention."""

    def __init__(self, cfg: Config, i: int):
        super().__init__()
        self.i, self.head_dim = i, cfg.d // cfg.heads
        d, f = cfg.d, cfg.hidden
        self.ln1, self.qkv, self.out = nn.LayerNorm(d), Linear(d, 3 * d), Linear(d, d)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), Linear(d, f), Linear(f, d)

    def attend(self, qkv):
        return attention(qkv, self.head_dim, causal=True)

    def forward(self, x):
        x = x + dropout(self.out(self.attend(self.qkv(self.ln1(x)))), f"{self.i}.attn")
        h = F.gelu(self.fc1(self.ln2(x)))
        h = dropout(h, f"{self.i}.hidden", feature=_features_held(self.fc1.weight, h))
        return x + dropout(self.fc2(h), f"{self.i}.mlp")


def _features_held(weight, h) -> tuple | None:
    """(offset, total) of the hidden features this rank holds when torch's ``ColwiseParallel`` cut
    fc1 over a mesh (its weight is then a DTensor of the global shape); None when it holds all."""
    total = weight.shape[0]
    if h.shape[-1] == total:
        return None
    return (weight.device_mesh.get_local_rank() * h.shape[-1], total)


class Head(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.norm, self.unembed = nn.LayerNorm(cfg.d), Linear(cfg.d, cfg.vocab)

    def forward(self, x):
        return self.unembed(self.norm(x))


def param_slices(name: str, shape: tuple, tp: int, k: int) -> tuple[tuple, bool]:
    """(index, sharded) of parameter ``name`` on tensor rank k of tp: QKV and fc1 are cut by rows
    (column-parallel), out and fc2's weights by columns (row-parallel); the rest stays whole."""
    full = tuple(slice(0, n) for n in shape)
    leaf = name.split(".", 1)[1] if "." in name else name
    if tp == 1:
        return full, False
    dim = {"qkv.weight": 0, "qkv.bias": 0, "fc1.weight": 0, "fc1.bias": 0,
           "out.weight": 1, "fc2.weight": 1}.get(leaf)
    if dim is None:
        return full, False
    n = shape[dim] // tp
    index = list(full)
    index[dim] = slice(k * n, (k + 1) * n)
    return tuple(index), True


def init_weights(model: nn.Sequential, cfg: Config, rule, coords: dict | None = None,
                 tp: int = 1) -> nn.Sequential:
    """Fill every parameter from ``rule``: Linear and Embedding weights uniform in +-1/sqrt(fan in)
    (+-1 for embeddings), biases likewise, LayerNorms 1 and 0. Where tensor rank ``coords['tp']`` of
    ``tp`` keeps only a slice of a tensor, the rule is asked for that slice; the rest of the full
    tensor stays 0 (the rank never uses it). Returns the model."""
    coords = coords or {"dp": 0, "tp": 0, "pp": 0, "cp": 0}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm." in f".{name}" or ".ln" in f".{name}":
                p.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            embedding = ".tok." in name or ".pos." in name
            fan_in = p.shape[1] if p.dim() == 2 and not embedding else None
            if fan_in is None and p.dim() == 1:   # a bias: its layer's fan in
                fan_in = dict(model.named_parameters())[name.rsplit(".", 1)[0] + ".weight"].shape[1]
            bound = 1.0 / math.sqrt(fan_in) if fan_in else 1.0
            index, sharded = param_slices(name, tuple(p.shape), tp, coords.get("tp", 0))
            u = rule(Draw(f"init {name}", 0, tuple(p.shape), index, sharded, coords, cfg.seed))
            p.zero_()
            p[index] = (2 * u - 1) * bound
    return model


def build(cfg: Config, rule, coords: dict | None = None, tp: int = 1) -> nn.Sequential:
    """The GPT as a sequence of layers (a pipeline cuts it anywhere), initialised by ``rule``."""
    cfg.check()
    model = nn.Sequential(Embed(cfg), *[Block(cfg, i) for i in range(cfg.layers)], Head(cfg))
    return init_weights(model, cfg, rule, coords, tp)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of the cross-entropies of the real tokens, their number): padding targets are IGNORE."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                            reduction="sum")
    return total, int((targets != IGNORE).sum())


def variable_batches(corpus: CharCorpus, steps: int, batch: int, seq: int, shortest: int = 4,
                     seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` pairs (X, Y) of ``batch`` rows: row i is a window of L_i + 1 characters of the
    text, L_i uniform in [shortest, seq], padded to ``seq`` (inputs with 0, targets with IGNORE)."""
    if not 1 <= shortest <= seq:
        raise ValueError(f"shortest={shortest}: give a length between 1 and seq={seq}")
    if len(corpus.ids) <= seq + 1:
        raise ValueError(f"a text of {len(corpus.ids)} characters holds no window of {seq + 1}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        X = torch.zeros(batch, seq, dtype=torch.long)
        Y = torch.full((batch, seq), IGNORE, dtype=torch.long)
        for r in range(batch):
            n = int(torch.randint(shortest, seq + 1, (1,), generator=g))
            s = int(torch.randint(0, len(corpus.ids) - n - 1, (1,), generator=g))
            X[r, :n], Y[r, :n] = corpus.ids[s:s + n], corpus.ids[s + 1:s + n + 1]
        out.append((X, Y))
    return out
