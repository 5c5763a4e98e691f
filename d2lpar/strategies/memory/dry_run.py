"""A large model's memory per GPU, planned on a laptop: FSDP2 (and tensor parallelism) on fake
tensors.

``torch.distributed``'s *fake* backend answers every collective at once without sending anything,
and ``FakeTensorMode`` makes tensors that have a shape, a dtype and a device but no storage: a model
of 8 billion parameters "allocates" nothing. Together they let one process play rank 0 of a world of
64 and run torch's real sharding code (``fully_shard``, ``parallelize_module``) and a real training
step (forward, backward, ``AdamW.step``). ``FSDPMemTracker`` follows every tensor as it is created
and freed and files it under a category, so its peaks are what rank 0 of the real job would hold:

    sharded parameters   4P/N           what each rank keeps between steps (fp32)
    sharded gradients    4P/N           after the reduce-scatter
    optimizer state      8P/N           AdamW's two moments
    unsharded parameters                the all-gathered blocks alive at once
    all-gather and reduce-scatter buffers, activations, temporaries

(P parameters, N ranks in the sharding dimension; with tensor parallelism of degree t, the blocks'
parameters are first cut in t, then each piece sharded over N/t). ``dry_run`` returns these figures
for a model built by ``model_fn`` on a mesh of ``mesh_shape``; ``d2lpar.cost.memory_levers`` has the
formulas they are checked against.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from d2lpar.strategies.tensor.blocks import TransformerLayer

__all__ = ["GPTConfig", "GPT", "LLAMA_8B_LIKE", "LLAMA_70B_LIKE", "DryRun", "dry_run"]


@dataclass(frozen=True)
class GPTConfig:
    """A decoder of the course's transformer layers (notebook 12): pre-LayerNorm, full attention,
    a two-matrix GELU MLP, an embedding and an untied output layer."""
    layers: int
    d: int
    heads: int
    hidden: int
    vocab: int

    def parameters(self) -> int:
        layer = 4 * self.d * self.d + 4 * self.d + 2 * self.d * self.hidden + self.hidden + self.d \
            + 4 * self.d   # qkv and out (with biases), fc1 and fc2 (with biases), two LayerNorms
        # embedding, output, final norm
        return self.layers * layer + 2 * self.vocab * self.d + 2 * self.d


# Llama 3 8B and 70B's widths, depths, heads and vocabulary. Their layers (grouped-query attention,
# a 3-matrix SwiGLU MLP) hold as many parameters as the course's layer with these MLP widths, so the
# models have Llama's parameter counts (8.03 B and 70.6 B) and the activations of the
# course's layer.
LLAMA_8B_LIKE = GPTConfig(layers=32, d=4096, heads=32, hidden=18432, vocab=128256)
LLAMA_70B_LIKE = GPTConfig(layers=80, d=8192, heads=64, hidden=35840, vocab=128256)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.vocab, cfg.d)
        self.layers = nn.ModuleList(TransformerLayer(cfg.d, cfg.heads, cfg.hidden)
                                    for _ in range(cfg.layers))
        self.norm, self.out = nn.LayerNorm(cfg.d), nn.Linear(cfg.d, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


@dataclass
class DryRun:
    """Rank 0's bytes per category (FSDPMemTracker's names, lower case) and what the run cost.

    ``peak``: each category at the moment the total peaked (often early in the backward pass, the
    root's and one layer's gathered parameters alive; for some shapes at the end of the backward,
    or inside ``AdamW.step``, whose temporaries are filed as 'opt'); ``after_forward``: when the
    loss is computed (every saved activation); ``after_backward``: at the end of the backward pass
    (the sharded gradients); ``in_layer``: when the first layer starts its forward (its gathered
    parameters and all-gather buffer alive); all of the second, steady step.
    """
    world: int
    mesh_shape: tuple[int, ...]
    parameters: int
    peak: dict[str, int]
    after_forward: dict[str, int]
    after_backward: dict[str, int]
    seconds: float
    rss_bytes: int
    parameter_tensors: int
    in_layer: dict[str, int] | None = None

    def measured(self) -> dict[str, int]:
        """Each category from the snapshot where it is whole (``dry_run_formula``'s keys): never
        the peak's, which may hold AdamW's temporaries or no all-gather buffer at all."""
        return {"sharded_param": self.after_forward["sharded_param"],
                "sharded_grad": self.after_backward["sharded_grad"],
                "opt": self.after_forward["opt"],   # AdamW's moments, no step's temporaries
                "unsharded_param": self.after_forward["unsharded_param"],
                "all_gather": self.in_layer["all_gather"], "act": self.after_forward["act"]}


_PLANS = ("fsdp", "fsdp+tp")


def _check(mesh_shape, plan, cfg: GPTConfig | None, world: int | None, batch: int = 1,
           seq: int = 1):
    if not (isinstance(batch, int) and isinstance(seq, int) and batch >= 1 and seq >= 1):
        raise ValueError(f"batch={batch!r}, seq={seq!r}: give at least one sequence of one token "
                         "(integers)")
    if plan not in _PLANS:
        raise ValueError(f"plan={plan!r}: use 'fsdp' (mesh (N,)) or 'fsdp+tp' (mesh (dp, tp))")
    shape = tuple(mesh_shape)
    if not shape or any(not isinstance(n, int) or n < 1 for n in shape):
        raise ValueError(f"mesh_shape={mesh_shape!r}: give positive integers, e.g. (8,) or (4, 2)")
    if len(shape) != (1 if plan == "fsdp" else 2):
        raise ValueError(f"plan {plan!r} needs a mesh of {1 if plan == 'fsdp' else 2} "
                         "dimension(s), "
                         f"got {shape}")
    if world is not None and math.prod(shape) != world:
        raise ValueError(f"the mesh {shape} holds {math.prod(shape)} ranks, not the world of "
                         f"{world}: "
                         "make the product of the mesh's sizes the world size")
    if cfg is not None and plan == "fsdp+tp":
        t = shape[1]
        for name, size in (("heads", cfg.heads), ("d", cfg.d), ("hidden", cfg.hidden)):
            if size % t:
                raise ValueError(f"{name}={size} does not divide over tensor-parallel degree {t}: "
                                 f"use a degree that divides {name}")


def _tensor_parallel(model: GPT, mesh) -> None:
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    for layer in model.layers:
        parallelize_module(layer, mesh, {"attn.qkv": ColwiseParallel(),
                                         "attn.out": RowwiseParallel(),
                                         "mlp.fc1": ColwiseParallel(),
                                         "mlp.fc2": RowwiseParallel()})


def dry_run(model_fn, mesh_shape=(8,), plan: str = "fsdp", batch: int = 1, seq: int = 2048,
            world: int | None = None, param_dtype: torch.dtype | None = None, log=None) -> DryRun:
    """Build ``model_fn()`` (a ``GPT``) on fake tensors, shard it with ``plan`` over a fake mesh of
    ``mesh_shape`` and run two training steps (AdamW); return rank 0's bytes per category.

    plan: 'fsdp' (``fully_shard`` per layer and at the root, mesh (N,)) or 'fsdp+tp' (mesh (dp, tp):
    the layers' linear layers split over tp with ``parallelize_module``, then ``fully_shard`` over
    dp). Runs in this process; a process group already initialised here is refused (the fake one
    must be the only one). ``param_dtype`` (e.g. torch.bfloat16): ``fully_shard(..., mp_policy=
    MixedPrecisionPolicy(param_dtype, reduce_dtype=torch.float32))``, so gathered parameters,
    activations and gradients are bf16 while the shards and AdamW stay fp32. ``log(text)`` is called
    as the run goes (sharded, each step done).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _check(mesh_shape, plan, None, world, batch, seq)
    shape = tuple(mesh_shape)
    if dist.is_initialized():
        raise RuntimeError("dry_run starts its own fake process group: call it outside a launched "
                           "rank "
                           "(in the notebook's own process)")
    t0 = time.perf_counter()
    dist.init_process_group("fake", rank=0, world_size=math.prod(shape), store=FakeStore())
    try:
        names = ("dp",) if plan == "fsdp" else ("dp", "tp")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dp_mesh = mesh["dp"]            # sub-meshes are real tensors: cut them outside fake mode
        tp_mesh = mesh["tp"] if plan == "fsdp+tp" else None
        with torch.device("meta"):      # shapes only: shard them here, outside fake mode
            model = model_fn()
        if not isinstance(model, GPT):
            raise TypeError(f"model_fn built a {type(model).__name__}: the dry run shards and "
                            "trains dry_run.GPT (its layers, embedding and output), so return "
                            "GPT(GPTConfig(...))")
        _check(shape, plan, model.cfg, world)
        params = sum(p.numel() for p in model.parameters())
        if plan == "fsdp+tp":
            _tensor_parallel(model, tp_mesh)
        mp = {} if param_dtype is None else \
            {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)}
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh, **mp)
        fully_shard(model, mesh=dp_mesh, **mp)
        say = log or (lambda text: None)
        say(f"sharded over the fake mesh {shape} in {time.perf_counter() - t0:.1f} s")
        with FakeTensorMode(allow_non_fake_inputs=True):   # the meshes are real tensors
            model.to_empty(device="cpu")   # each rank's shards, as fake tensors: nothing allocated
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            tokens = torch.randint(0, model.out.out_features, (batch, seq))
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((tokens,))
            in_layer = []   # FSDP's own pre-forward hook, the all-gather, runs before this one
            model.layers[0].register_forward_pre_hook(
                lambda module, args: in_layer.append(tracker.get_tracker_snapshot()))
            with tracker:
                for step in range(2):   # the first step creates AdamW's state; the second is steady
                    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
                    forward = tracker.get_tracker_snapshot()
                    loss.backward()
                    del loss
                    after = tracker.get_tracker_snapshot()
                    opt.step()
                    opt.zero_grad()
                    tracker.reset_mod_stats()
                    say(f"step {step + 1} of 2 done at {time.perf_counter() - t0:.1f} s")
            snap = tracker.get_tracker_snapshot("peak")
            tensors = len(list(model.parameters()))
    finally:
        dist.destroy_process_group()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return DryRun(math.prod(shape), shape, params, _named(snap), _named(forward), _named(after),
                  time.perf_counter() - t0, rss, tensors, _named(in_layer[-1]))


def _named(snapshot) -> dict[str, int]:
    """FSDPMemTracker's {device: {category: bytes}} as {category name in lower case: bytes}."""
    per_device = next(iter(snapshot.values()))
    return {str(k).rsplit(".", 1)[-1].lower(): int(v) for k, v in per_device.items()}
