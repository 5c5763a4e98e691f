"""Which layout trains a model fastest on a cluster: every layout priced, the fastest that fits.

A layout (``layout.Layout``) cuts the GPUs into data x tensor x pipeline x context degrees and
picks ZeRO's stage, the micro-batches, checkpointing, sequence parallelism and the pipeline's
schedule; ``pricing`` prices its memory per GPU and its seconds per step with the course's
formulas (its docstring lists every term and where it comes from). The search tries every layout
whose degrees divide the model and the batch: tensor degrees inside a node (``max_tp`` allows
more), context degrees that leave each rank at least ``MIN_CP_TOKENS`` tokens, sequence parallelism
whenever there is a tensor degree (it moves the same bytes as the all-reduces and keeps less), the
embedding and loss cut over the tensor ranks, Megatron-LM's rank order, and for each pipeline
1F1B, ZB-H1 and the interleaved schedule with every v that divides a stage's layers. It keeps the
fastest that fit in the cluster's memory less its headroom.

MFU = ``pricing.model_flops_per_step`` / (step time x GPUs x peak FLOP/s).
"""

from __future__ import annotations

import textwrap

from d2lpar.cost.cluster import Cluster, check_cluster, group_links, usable_bytes
from d2lpar.cost.costmodel import Link
from d2lpar.cost.layout import Layout
from d2lpar.cost.pricing import (GB, Plan, hardware_flops_per_step, memory, model_flops_per_step,
                                 stage_parameters, step_time)
from d2lpar.cost.transformer import PRECISIONS, Model, check_model

__all__ = ["layouts", "search", "plan", "by_degrees", "why_lost", "figures", "describe",
           "MAX_MICRO", "MIN_CP_TOKENS"]

MAX_MICRO = 128       # the most micro-batches per step the search tries (or 8 per pipeline stage)
MIN_CP_TOKENS = 1024  # the fewest tokens of a sequence a context rank keeps in the search


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(model: Model, cluster: Cluster, micro=None, checkpoints=("none", "selective", "full"),
            zeros=(0, 1, 2, 3), max_tp: int | None = None, cps=None, schedules=None,
            keep=(False, True), vocab_parallel: bool = True):
    """Every layout to try (the module docstring). ``micro``: the micro-batch counts to try
    (default: every divisor of a data-parallel rank's batch up to ``MAX_MICRO``, or 8 per pipeline
    stage if that is more: a pipeline wants m well above p, Megatron-LM 2021, section 3.3.1);
    ``cps``: the
    context degrees (default: those leaving ``MIN_CP_TOKENS`` tokens per rank); ``schedules``:
    names among 1F1B, ZB-H1, interleaved (default all three); ``keep``: ZeRO-3's variants."""
    schedules = schedules or ("1F1B", "ZB-H1", "interleaved")
    for tp in _divisors(cluster.gpus):
        if (tp > (max_tp or cluster.gpus_per_node) or model.heads % tp or model.kv % tp
                or model.d % tp or model.f % tp):
            continue
        for cp in _divisors(cluster.gpus // tp):
            if cps is not None and cp not in cps:
                continue
            short = cps is None and model.seq < cp * MIN_CP_TOKENS
            if cp > 1 and (model.seq % (2 * cp) or short):
                continue
            for pp in _divisors(cluster.gpus // (tp * cp)):
                dp = cluster.gpus // (tp * cp * pp)
                if pp > model.layers or model.batch % dp:
                    continue
                most = max(MAX_MICRO, 8 * pp)
                counts = micro or [m for m in _divisors(model.batch // dp) if m <= most]
                per_stage = -(-model.layers // pp)
                for m in counts:
                    if model.batch % (dp * m):
                        continue
                    scheds = [("1F1B", 1)]
                    if pp > 1:
                        scheds += [("ZB-H1", 1)] if "ZB-H1" in schedules else []
                        if "interleaved" in schedules and m % pp == 0:
                            scheds += [("interleaved", v) for v in _divisors(per_stage) if v > 1]
                        if "1F1B" not in schedules:
                            scheds = scheds[1:]
                    for z in zeros:
                        if z and dp * cp == 1:
                            continue
                        for k in (keep if z == 3 else (False,)):
                            for c in checkpoints:
                                for s, v in scheds:
                                    yield Layout(dp, tp, pp, z, m, c, cp=cp, sp=tp > 1,
                                                 schedule=s, v=v, keep=k,
                                                 vocab_parallel=vocab_parallel)


def _check_top(top: int) -> None:
    if not isinstance(top, int) or top < 1:
        raise ValueError(f"top={top!r}: ask for at least one layout (a whole number >= 1)")


def search(model: Model, cluster: Cluster, **kw) -> list[Plan]:
    """Every layout priced (``layouts``), unsorted; ValueError if none suits the model."""
    check_model(model)
    check_cluster(cluster)
    limit = usable_bytes(cluster)
    plans = []
    for lay in layouts(model, cluster, **kw):
        mem = memory(model, lay)
        plans.append(Plan(lay, mem, step_time(model, cluster, lay), sum(mem.values()) <= limit))
    if not plans:
        raise ValueError(f"no layout of {cluster.gpus} GPUs suits {model.name}: the global batch "
                         f"of {model.batch} sequences must divide over the data-parallel ranks, "
                         f"and a tensor degree must divide the heads ({model.heads}) and the "
                         f"key/value heads ({model.kv})")
    return plans


def plan(model: Model, cluster: Cluster, top: int = 3, plans=None, **kw) -> list[Plan]:
    """The ``top`` fastest layouts that fit (among ``plans``, default: ``search``'s); ValueError
    naming the smallest memory found if none fits."""
    _check_top(top)
    plans = search(model, cluster, **kw) if plans is None else plans
    fitting = sorted((p for p in plans if p.fits), key=lambda p: p.step)
    if not fitting:
        small = min(plans, key=lambda p: p.peak_memory)
        raise ValueError(f"no layout fits {model.name} in {usable_bytes(cluster) / GB:.1f} GB per "
                         f"GPU: the smallest needs {small.peak_memory / GB:.1f} GB "
                         f"({small.layout}); more GPUs, GPUs with more memory, or a smaller "
                         f"global batch would help")
    return fitting[:top]


def _better(p: Plan, old: Plan | None) -> bool:
    if old is None:
        return True
    return (p.fits, -p.step if p.fits else -p.peak_memory) > \
        (old.fits, -old.step if old.fits else -old.peak_memory)


def by_degrees(model: Model, cluster: Cluster, plans=None, **kw) -> dict[tuple[int, int], Plan]:
    """For each (tp, pp), its fastest layout that fits or, if none fits, its smallest one
    (``Plan.fits`` tells which): the planner's map of where each degree belongs."""
    best: dict[tuple[int, int], Plan] = {}
    for p in plans if plans is not None else search(model, cluster, **kw):
        key = (p.layout.tp, p.layout.pp)
        if _better(p, best.get(key)):
            best[key] = p
    return best


def why_lost(winner: Plan, model: Model, cluster: Cluster, top: int = 4, plans=None,
             **kw) -> list[str]:
    """One line per (tp, pp) that lost: did not fit (and by how much), or which part of its step
    (the best layout with those degrees) exceeds the winner's most."""
    lines = []
    rivals = sorted(by_degrees(model, cluster, plans, **kw).values(),
                    key=lambda p: (not p.fits, p.step))
    for p in rivals:
        lay = p.layout
        if (lay.tp, lay.pp) == (winner.layout.tp, winner.layout.pp):
            continue
        if not p.fits:
            lines.append(f"tp {lay.tp} x pp {lay.pp}: does not fit, the smallest needs "
                         f"{p.peak_memory / GB:.1f} GB of {usable_bytes(cluster) / GB:.1f}")
            continue
        part = max(p.time, key=lambda k: p.time[k] - winner.time.get(k, 0.0))
        lines.append(f"tp {lay.tp} x pp {lay.pp}: {p.step:.3f} s, +{p.step - winner.step:.3f} s, "
                     f"most of it {part} (+{p.time[part] - winner.time.get(part, 0.0):.3f} s)")
    fit = [ln for ln in lines if "does not fit" not in ln][:top]
    return fit + [ln for ln in lines if "does not fit" in ln][:top]


def figures(p: Plan, model: Model, cluster: Cluster) -> dict[str, float]:
    """The plan's throughput: model and hardware TFLOP/s per GPU, tokens/s per GPU, MFU."""
    per_gpu = p.step * cluster.gpus
    return {"model_tflops": model_flops_per_step(model) / per_gpu / 1e12,
            "hardware_tflops": hardware_flops_per_step(model, p.layout) / per_gpu / 1e12,
            "tokens_per_gpu": model.batch * model.seq / per_gpu,
            "mfu": model_flops_per_step(model) / (per_gpu * cluster.peak_flops)}


def _link_name(link: Link, cluster: Cluster) -> str:
    return "NVLink" if link == cluster.intra else "network"


def describe(p: Plan, model: Model, cluster: Cluster) -> str:
    """The plan in a few lines of at most 100 characters."""
    lay = p.layout
    f = figures(p, model, cluster)
    links = group_links(cluster, {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "pp": lay.pp},
                        lay.order)
    groups = ", ".join(f"{k} {_link_name(links[k], cluster)}" for k in ("tp", "cp", "dp", "pp")
                       if getattr(lay, k) > 1) or "one GPU"
    mem = ", ".join(f"{k} {v / GB:.1f}" for k, v in p.memory.items())
    t = ", ".join(f"{k} {v:.2f}" for k, v in p.time.items())
    step = textwrap.fill(f"step {p.step:.3f} s: {t}", 96, subsequent_indent="      ")
    stage = "" if lay.pp == 1 else " (the fullest stage)"
    head = textwrap.fill(str(lay), 100, subsequent_indent="    ")
    return (f"{head}\n    --layout {lay.spec()}\n    links ({lay.order}): {groups}\n"
            f"    memory per GPU{stage} {p.peak_memory / GB:.1f} GB of "
            f"{usable_bytes(cluster) / GB:.1f} usable:\n      {mem}\n"
            f"    {step}\n"
            f"    {f['model_tflops']:.0f} TFLOP/s per GPU of the model's FLOPs, "
            f"{f['hardware_tflops']:.0f} of the hardware's; {f['tokens_per_gpu']:,.0f} tokens/s "
            f"per GPU\n    MFU {100 * f['mfu']:.1f} %")


def _stage_parameters(model: Model, lay: Layout) -> float:
    """Parameters one GPU of the fuller end stage holds before ZeRO
    (``pricing.stage_parameters``)."""
    return max(stage_parameters(model, lay, 0), stage_parameters(model, lay, lay.pp - 1))


def _bytes(model: Model) -> dict[str, int]:
    check_model(model)
    return PRECISIONS[model.precision]


def _cluster(gpus, per_node, mem, peak, intra, inter, name):
    """A cluster with the presets' latencies (5 us, 10 us) and utilisation (60 %)."""
    return Cluster(name, gpus, per_node, mem, peak, 0.6, intra, 5e-6, inter, 10e-6)
