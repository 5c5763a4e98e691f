"""Which layout trains a model fastest on a cluster: data x tensor x pipeline, ZeRO, micro-batches,
checkpointing, each priced with the course's own formulas.

For every layout (dp, tp, pp with dp tp pp = the GPUs; tensor parallelism inside a node when it fits,
as Megatron-LM places it), ZeRO stage 0-3 over dp, micro-batch counts and checkpointing mode:

**memory per GPU** (bf16 weights, fp32 master weights and AdamW moments: 2 + 2 + 12 bytes per
parameter, ``zero.model_state_bytes``; the parameters of one pipeline stage, cut in tp, sharded over
dp by ZeRO) + **activations** (``memory_levers``: the layer's saved bytes in bf16, per micro-batch, times
the micro-batches 1F1B keeps in flight on the first stage, ``bubble.peak_microbatches``; with
checkpointing the layer inputs only, plus one layer recomputed);

**time per step** = compute (``tp_cost.layer_flops``: forward, backward twice, the recomputed forward;
at the cluster's sustained FLOP/s) + the pipeline's bubble (``bubble.megatron_ratio`` of the compute)
+ tensor parallelism's 4 all-reduces per layer and micro-batch (``costmodel.allreduce_time``; over
NVLink inside a node, the network across) + the data-parallel gradient reduction left after the
backward pass has hidden what it can (``zero.sent_bytes``) + the pipeline's point-to-point messages.

MFU = the model's FLOPs (6 P per token plus attention, P without the input embedding, no
recomputation: ``model_flops_per_step``) / (step time x GPUs x peak).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

from d2lpar.cost import memory_levers as ML
from d2lpar.cost.bubble import megatron_ratio, peak_microbatches
from d2lpar.cost.costmodel import Link, Machine, allreduce_time
from d2lpar.cost.tp_cost import layer_flops
from d2lpar.strategies.sharded.zero import model_state_bytes, sent_bytes

__all__ = ["Model", "Cluster", "Layout", "Plan", "memory", "step_time", "evaluate", "plan", "describe",
           "layouts", "model_flops_per_step", "check_cluster", "by_degrees", "why_lost", "PRECISIONS",
           "check_layout", "MODELS", "CLUSTERS", "main", "MAX_MICRO"]

GB = 1e9


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    d: int
    heads: int
    seq: int
    vocab: int
    batch: int            # global batch, in sequences
    hidden: int = 0       # MLP width (0: 4 d)
    precision: str = "bf16"   # 'bf16' (mixed: fp32 master weights) or 'fp32'

    @property
    def f(self) -> int:
        return self.hidden or 4 * self.d

    def parameters(self) -> float:
        P_split, P_rest, _, _ = ML.split_parameters(self.layers, self.d, self.heads, self.f, self.vocab)
        return P_split + P_rest


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus: int
    gpus_per_node: int
    memory_gb: float
    peak_flops: float          # dense bf16 peak per GPU
    utilisation: float         # the share of the peak large matmuls sustain
    intra_bandwidth: float     # bytes/s per GPU inside a node
    intra_latency: float
    inter_bandwidth: float     # bytes/s per GPU between nodes
    inter_latency: float


def check_cluster(c: Cluster) -> None:
    for f in fields(c):
        v = getattr(c, f.name)
        if f.name != "name" and (v is None or not v > 0):
            raise ValueError(f"cluster {c.name!r}: {f.name}={v!r} is missing or not positive; describe "
                             f"every field (GPUs, memory, FLOP/s, bandwidths and latencies)")
    if c.gpus % c.gpus_per_node and c.gpus > c.gpus_per_node:
        raise ValueError(f"cluster {c.name!r}: {c.gpus} GPUs are not whole nodes of {c.gpus_per_node}")


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: int = 1
    micro: int = 1           # micro-batches per step (per data-parallel rank)
    checkpoint: str = "none"

    def __str__(self) -> str:
        return (f"dp {self.dp} x tp {self.tp} x pp {self.pp}, ZeRO-{self.zero}, {self.micro} micro-batches, "
                f"checkpointing {self.checkpoint}")


def check_layout(model: Model, cluster: Cluster, lay: Layout) -> None:
    """One sentence per impossible layout (the planner never proposes one)."""
    if lay.dp * lay.tp * lay.pp != cluster.gpus:
        raise ValueError(f"dp x tp x pp = {lay.dp} x {lay.tp} x {lay.pp} = {lay.dp * lay.tp * lay.pp}, "
                         f"not the cluster's {cluster.gpus} GPUs")
    for name, size in (("heads", model.heads), ("d", model.d), ("hidden", model.f)):
        if size % lay.tp:
            raise ValueError(f"tensor degree {lay.tp} does not divide {name}={size}")
    if lay.pp > model.layers:
        raise ValueError(f"pipeline degree {lay.pp} is more than the {model.layers} layers")
    if model.batch % (lay.dp * lay.micro):
        raise ValueError(f"the global batch of {model.batch} does not cut into dp {lay.dp} x "
                         f"{lay.micro} micro-batches")


# bytes per parameter (weights, gradients, optimizer state: bf16 mixed keeps fp32 master weights and
# AdamW's two fp32 moments) and per activation value
PRECISIONS = {"bf16": {"param": 2, "grad": 2, "optimizer": 12, "act": 2},
              "fp32": {"param": 4, "grad": 4, "optimizer": 8, "act": 4}}


def _bytes(model: Model) -> dict[str, int]:
    if model.precision not in PRECISIONS:
        raise ValueError(f"precision={model.precision!r}: use one of {sorted(PRECISIONS)}")
    return PRECISIONS[model.precision]


def _stage_parameters(model: Model, lay: Layout) -> float:
    """Parameters one GPU of the largest stage holds before ZeRO: its layers cut in tp, the
    embedding and the output layer whole (one of them per end stage once there is a pipeline)."""
    _, _, p_split, p_rest = ML.split_parameters(1, model.d, model.heads, model.f, model.vocab)
    layers = math.ceil(model.layers / lay.pp)
    ends = 2 if lay.pp == 1 else 1
    return layers * (p_split / lay.tp + p_rest) + ends * model.vocab * model.d + 2 * model.d


def memory(model: Model, lay: Layout) -> dict[str, float]:
    """Bytes per GPU by category (the first pipeline stage: it holds the most activations).

    ZeRO-3 also holds, while a layer runs, that layer's gathered parameters and the embedding and
    output layer (the root unit): notebook 14's dry run measures them as 'unsharded' and
    'all-gather'.
    With no pipeline, the one stage also keeps the output layer's activations (its logits)."""
    by = _bytes(model)
    psi = _stage_parameters(model, lay)
    states = model_state_bytes(lay.zero, psi, lay.dp, param_bytes=by["param"],
                               grad_bytes=by["grad"], optimizer_bytes=by["optimizer"])
    b = model.batch // (lay.dp * lay.micro)          # sequences per micro-batch
    s, d = model.seq, model.d
    layers = math.ceil(model.layers / lay.pp)
    in_flight = peak_microbatches("1F1B", lay.pp, lay.micro)[0]
    scale = by["act"] / 4      # the levers' formulas count fp32 bytes
    full = ML.layer_activations(b, s, d, model.heads, model.f, lay.tp) * scale
    if lay.checkpoint == "full":
        per_mb = layers * ML.input_bytes(b, s, d) * scale / lay.tp
        act = per_mb * in_flight + full
    elif lay.checkpoint == "selective":
        per_mb = layers * by["act"] * b * s * (6 * d + model.f) / lay.tp
        act = per_mb * in_flight + full
    else:
        act = layers * full * in_flight
    if lay.pp == 1:   # final LayerNorm, the output layer's input, its logits' log-softmax
        act += by["act"] * (2 * b * s * d + 2 * b * s + b * s * model.vocab)
    out = {"parameters": states["params"], "gradients": states["grads"],
           "optimizer": states["optimizer"], "activations": act}
    if lay.zero == 3 and lay.dp > 1:
        _, _, p_split, p_rest = ML.split_parameters(1, d, model.heads, model.f, model.vocab)
        ends = (2 if lay.pp == 1 else 1) * model.vocab * d + 2 * d
        out["gathered"] = by["param"] * (p_split / lay.tp + p_rest + ends)
    return out


def _link(cluster: Cluster, span: int) -> Link:
    """The link a group of ``span`` consecutive GPUs uses: NVLink inside a node, else the network."""
    if span <= cluster.gpus_per_node:
        return Link(cluster.intra_bandwidth, cluster.intra_latency)
    return Link(cluster.inter_bandwidth, cluster.inter_latency)


def _machine(cluster: Cluster, link: Link, n: int) -> Machine:
    return Machine(cluster.name, n, link, reduce_bandwidth=1e12)


def step_time(model: Model, cluster: Cluster, lay: Layout,
              dp_overlap: bool = True) -> dict[str, float]:
    """Seconds per step: compute, bubble, exposed tensor/data/pipeline communication.

    dp_overlap: the data-parallel reduction runs in buckets during the backward pass (DDP, FSDP);
    False: after it (the course's hand-built 3D run), all of it exposed."""
    rate = cluster.peak_flops * cluster.utilisation
    b = model.batch // (lay.dp * lay.micro)
    layers = math.ceil(model.layers / lay.pp)
    per_mb = 3 * layers * layer_flops(b, model.seq, model.d, model.f) / lay.tp
    per_mb += ML.recompute_flops(lay.checkpoint, layers, b, model.seq, model.d, model.f) / lay.tp
    head = 6 * b * model.seq * model.d * model.vocab / lay.tp
    compute = lay.micro * (per_mb + head) / rate
    bubble = megatron_ratio(lay.pp, lay.micro) * compute
    tp_link = _link(cluster, lay.tp)   # tp innermost: consecutive GPUs
    act = _bytes(model)["act"] * b * model.seq * model.d   # one activation
    tp = 0.0 if lay.tp == 1 else lay.micro * layers * 4 * allreduce_time(
        "ring", act, lay.tp, _machine(cluster, tp_link, lay.tp))
    psi = _stage_parameters(model, lay)
    dp_link = _link(cluster, lay.tp * lay.dp)
    dp_bytes = (sent_bytes(lay.zero, psi, lay.dp, param_bytes=_bytes(model)["grad"])
                if lay.dp > 1 else 0.0)
    dp_comm = (0.0 if lay.dp == 1
               else (lay.dp - 1) * dp_link.latency * 2 + dp_bytes / dp_link.bandwidth)
    backward = compute * 2 / 3
    dp = max(0.0, dp_comm - backward) if dp_overlap else dp_comm   # buckets overlap the backward
    pp_link = _link(cluster, cluster.gpus)   # stages span nodes once the model is cut that way
    pp = 0.0 if lay.pp == 1 else 2 * (lay.micro + lay.pp - 1) * pp_link.time(act / lay.tp)
    return {"compute": compute, "bubble": bubble, "tensor": tp, "data": dp, "pipeline": pp}


def model_flops_per_step(model: Model) -> float:
    """Model FLOPs of one step (PaLM, Chowdhery et al. 2022, appendix B): per token 6 P for the
    weights' products (2 forward, 4 backward) plus attention's 12 L s d; P without the input
    embedding table (a lookup multiplies nothing; the output layer counts, as in torchtitan's MFU);
    a recomputed forward is not counted (it is work the model did not need)."""
    tokens = model.batch * model.seq
    P = model.parameters() - model.vocab * model.d
    return (6 * P + 12 * model.layers * model.seq * model.d) * tokens


@dataclass
class Plan:
    layout: Layout
    memory: dict[str, float]
    time: dict[str, float]
    fits: bool

    @property
    def step(self) -> float:
        return sum(self.time.values())

    @property
    def peak_memory(self) -> float:
        return sum(self.memory.values())


def evaluate(model: Model, cluster: Cluster, lay: Layout) -> Plan:
    check_layout(model, cluster, lay)
    mem = memory(model, lay)
    return Plan(lay, mem, step_time(model, cluster, lay), sum(mem.values()) <= cluster.memory_gb * GB)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


MAX_MICRO = 128   # the most micro-batches per step the search tries


def layouts(model: Model, cluster: Cluster, micro=None, checkpoints=("none", "selective", "full"),
            zeros=(0, 1, 2, 3), max_tp: int | None = None):
    """Every layout to try; tensor parallelism stays inside a node unless ``max_tp`` allows more.
    Micro-batch counts: every divisor of a data-parallel rank's batch up to ``MAX_MICRO``, unless
    ``micro`` lists the counts to try."""
    for tp in _divisors(cluster.gpus):
        if (tp > (max_tp or cluster.gpus_per_node)
                or model.heads % tp or model.d % tp or model.f % tp):
            continue
        for pp in _divisors(cluster.gpus // tp):
            dp = cluster.gpus // (tp * pp)
            if pp > model.layers:
                continue
            counts = micro or [m for m in _divisors(model.batch // dp) if m <= MAX_MICRO] \
                if model.batch % dp == 0 else ()
            for m in counts:
                if model.batch % (dp * m):
                    continue
                for z in zeros:
                    if z and dp == 1:
                        continue
                    for c in checkpoints:
                        yield Layout(dp, tp, pp, z, m, c)


def plan(model: Model, cluster: Cluster, top: int = 3, **kw) -> list[Plan]:
    """The ``top`` fastest layouts that fit; ValueError naming the smallest memory found if none
    fits."""
    check_cluster(cluster)
    plans = [evaluate(model, cluster, lay) for lay in layouts(model, cluster, **kw)]
    if not plans:
        raise ValueError(f"no layout of {cluster.gpus} GPUs suits {model.name}: the global batch "
                         f"of {model.batch} must divide over the data-parallel ranks")
    fitting = sorted((p for p in plans if p.fits), key=lambda p: p.step)
    if not fitting:
        small = min(plans, key=lambda p: p.peak_memory)
        raise ValueError(f"no layout fits {model.name} in {cluster.memory_gb:g} GB per GPU: the "
                         f"smallest needs {small.peak_memory / GB:.1f} GB ({small.layout}); more "
                         f"GPUs, GPUs with more memory, or a smaller global batch would help")
    return fitting[:top]


def by_degrees(model: Model, cluster: Cluster, **kw) -> dict[tuple[int, int], Plan]:
    """For each (tp, pp), its fastest layout that fits or, if none fits, its smallest one
    (``Plan.fits`` tells which): the planner's map of where each degree belongs."""
    check_cluster(cluster)
    best: dict[tuple[int, int], Plan] = {}
    for lay in layouts(model, cluster, **kw):
        p = evaluate(model, cluster, lay)
        key, old = (lay.tp, lay.pp), best.get((lay.tp, lay.pp))
        if old is None or (p.fits, -p.step if p.fits else -p.peak_memory) > \
                (old.fits, -old.step if old.fits else -old.peak_memory):
            best[key] = p
    return best


def why_lost(winner: Plan, model: Model, cluster: Cluster, top: int = 4, **kw) -> list[str]:
    """One line per (tp, pp) that lost: did not fit (and by how much), or which part of its step
    (the best layout with those degrees) exceeds the winner's most."""
    lines = []
    rivals = sorted(by_degrees(model, cluster, **kw).values(), key=lambda p: (not p.fits, p.step))
    for p in rivals:
        lay = p.layout
        if (lay.tp, lay.pp) == (winner.layout.tp, winner.layout.pp):
            continue
        if not p.fits:
            lines.append(f"tp {lay.tp} x pp {lay.pp}: does not fit, the smallest needs "
                         f"{p.peak_memory / GB:.1f} GB of {cluster.memory_gb:g}")
            continue
        part = max(p.time, key=lambda k: p.time[k] - winner.time.get(k, 0.0))
        lines.append(f"tp {lay.tp} x pp {lay.pp}: {p.step:.3f} s, +{p.step - winner.step:.3f} s, "
                     f"most of it {part} (+{p.time[part] - winner.time.get(part, 0.0):.3f} s)")
    fit = [ln for ln in lines if "does not fit" not in ln][:top]
    return fit + [ln for ln in lines if "does not fit" in ln][:top]


def describe(p: Plan, model: Model, cluster: Cluster) -> str:
    mfu = model_flops_per_step(model) / (p.step * cluster.gpus * cluster.peak_flops)
    mem = ", ".join(f"{k} {v / GB:.1f}" for k, v in p.memory.items())
    t = ", ".join(f"{k} {v:.3f}" for k, v in p.time.items())
    return (f"{p.layout}\n    memory per GPU {p.peak_memory / GB:.1f} GB:\n      {mem}\n"
            f"    step {p.step:.3f} s, MFU {mfu:.1%}:\n      {t}")


def _cluster(gpus, per_node, mem, peak, intra, inter, name):
    return Cluster(name, gpus, per_node, mem, peak, 0.6, intra, 5e-6, inter, 10e-6)


# Described clusters: A100s (312 TFLOP/s bf16 peak) and H100s (989), 8 per node behind NVSwitch
# (about 230 and 450 GB/s per GPU for collectives), one 200 or 400 Gb/s network card per GPU.
CLUSTERS = {
    "1024 A100-80GB": _cluster(1024, 8, 80, 312e12, 230e9, 25e9, "1024 A100-80GB"),
    "8 H100": _cluster(8, 8, 80, 989e12, 450e9, 50e9, "8 H100"),
    "64 H100": _cluster(64, 8, 80, 989e12, 450e9, 50e9, "64 H100"),
}
MODELS = {
    "gpt3-175b": Model("GPT-3 175B", 96, 12288, 96, 2048, 51200, 1536),
    "llama-8b-like": Model("8B (Llama 3 8B's sizes)", 32, 4096, 32, 8192, 128256, 64, hidden=18432),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m d2lpar plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt3-175b", help=f"one of {sorted(MODELS)}, or 'custom'")
    p.add_argument("--cluster", default="1024 A100-80GB", help=f"one of {sorted(CLUSTERS)}, or 'custom'")
    for name in ("layers", "d", "heads", "seq", "vocab", "batch", "hidden", "gpus", "gpus-per-node"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--memory-gb", type=float, default=None)
    p.add_argument("--top", type=int, default=3)
    a = p.parse_args(argv)
    model = MODELS.get(a.model) or Model("custom", a.layers, a.d, a.heads, a.seq, a.vocab, a.batch,
                                         a.hidden or 0)
    cluster = CLUSTERS.get(a.cluster)
    if cluster is None:
        cluster = _cluster(a.gpus, a.gpus_per_node, a.memory_gb, 989e12, 450e9, 50e9, "custom")
    if None in (model.layers, model.d, model.heads, model.seq, model.vocab, model.batch):
        p.error("a custom model needs --layers, --d, --heads, --seq, --vocab and --batch")
    try:
        best = plan(model, cluster, top=a.top)
        print(f"{model.name} ({model.parameters() / 1e9:.1f} B parameters) on {cluster.name}:")
        for p in best:
            print(describe(p, model, cluster))
        print("why the other degrees lost (each with its best ZeRO stage, micro-batches, checkpointing):")
        for line in why_lost(best[0], model, cluster):
            print("    " + line)
    except ValueError as e:
        print(f"python -m d2lpar plan: error: {e}")
        return 2
    return 0
