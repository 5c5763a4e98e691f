"""python -m d2lpar plan: the fastest layouts for a model on a cluster, or the price of one.

Start from a described model and cluster (``presets``) or describe your own; any size given on the
command line replaces the preset's. ``--layout`` prices one layout instead of searching. Impossible
input is refused in one sentence with exit status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from dataclasses import replace

from d2lpar.cost.cluster import Cluster, check_cluster, usable_bytes
from d2lpar.cost.layout import LAYOUT_KEYS, parse_layout
from d2lpar.cost.plan_search import describe, plan, search, why_lost
from d2lpar.cost.presets import CLUSTERS, HARDWARE, MODELS, hardware_cluster
from d2lpar.cost.pricing import GB, evaluate
from d2lpar.cost.transformer import ATTENTIONS, PRECISIONS, Model, check_model

__all__ = ["main", "build_parser"]

PROG = "python -m d2lpar plan"


class Usage(Exception):
    """Bad input: one sentence for the user."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):   # one sentence, no usage block
        raise Usage(message)


def _whole(name: str, minimum: int = 1):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, not {text!r}") \
                from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be at least {minimum}, not {v}")
        return v
    return parse


def _number(name: str, low: float = 0.0, high: float = math.inf, low_open: bool = True,
            high_open: bool = True):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, not {text!r}") from None
        ok = math.isfinite(v) and (v > low if low_open else v >= low) and \
            (v < high if high_open else v <= high)
        if not ok:
            left, right = "(" if low_open else "[", ")" if high_open else "]"
            raise argparse.ArgumentTypeError(f"{name} must be a number in {left}{low:g}, "
                                             f"{high:g}{right}, not {text}")
        return v
    return parse


def _flag(name: str):
    def parse(text: str) -> bool:
        if text not in ("0", "1"):
            raise argparse.ArgumentTypeError(f"{name} takes 0 or 1, not {text!r}")
        return text == "1"
    return parse


MODEL_SIZES = ("layers", "d", "heads", "seq", "vocab", "batch")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="--layout keys (comma-separated key=value):\n" + "\n".join(
                    textwrap.fill(v, 96, initial_indent=f"  {k:<11}", subsequent_indent=" " * 13)
                    for k, v in LAYOUT_KEYS.items()) +
                "\nExample: --layout dp=16,tp=8,pp=8,sp=1,zero=1,micro=96,checkpoint=selective,"
                "schedule=interleaved:2")
    m = p.add_argument_group("the model (a preset, or 'custom' with every size given)")
    m.add_argument("--model", default="gpt3-175b",
                   help=f"a preset: {', '.join(MODELS)}; or 'custom' (default gpt3-175b)")
    m.add_argument("--layers", type=_whole("--layers"), help="transformer layers")
    m.add_argument("--d", type=_whole("--d"), help="the model width (hidden size)")
    m.add_argument("--heads", type=_whole("--heads"), help="attention heads (they divide --d)")
    m.add_argument("--kv-heads", type=_whole("--kv-heads"),
                   help="key/value heads, grouped-query attention (default: as many as --heads)")
    m.add_argument("--ffn", "--hidden", dest="ffn", type=_whole("--ffn"),
                   help="the MLP's inner width (default 4 x --d); --hidden is the old name")
    m.add_argument("--glu", type=_flag("--glu"),
                   help="1: a gated MLP (SwiGLU, three matrices); 0: two matrices (GELU)")
    m.add_argument("--vocab", type=_whole("--vocab"), help="vocabulary size")
    m.add_argument("--seq", type=_whole("--seq"), help="sequence length in tokens")
    m.add_argument("--batch", type=_whole("--batch"), help="global batch per step, in sequences")
    m.add_argument("--tied", type=_flag("--tied"), help="1: the output layer is the embedding's")
    m.add_argument("--bias", type=_flag("--bias"), help="1: the linear layers have biases")
    m.add_argument("--dropout", type=_flag("--dropout"), help="1: dropout (its masks are kept)")
    m.add_argument("--attention", choices=ATTENTIONS,
                   help="eager (the attention scores are stored) or flash (FlashAttention)")
    m.add_argument("--precision", choices=sorted(PRECISIONS),
                   help="bf16 (2+2+12 bytes per parameter), bf16-fp32-grads (2+4+12: fp32 "
                        "gradients, Megatron-LM's and Llama 3's) or fp32 (4+4+8)")
    c = p.add_argument_group("the cluster (a preset, or 'custom' with every figure given)")
    c.add_argument("--cluster", default="1024 A100-80GB",
                   help=f"a preset: {', '.join(repr(k) for k in CLUSTERS)}; a GPU kind "
                        f"({', '.join(HARDWARE)}) with --gpus; or 'custom' (default "
                        f"'1024 A100-80GB')")
    c.add_argument("--gpus", type=_whole("--gpus"), help="GPUs in all (whole nodes)")
    c.add_argument("--gpus-per-node", type=_whole("--gpus-per-node"),
                   help="GPUs per node, joined by NVLink")
    c.add_argument("--gpu-memory-gb", "--memory-gb", dest="memory_gb",
                   type=_number("--gpu-memory-gb"), help="memory per GPU in GiB (an '80 GB' "
                   "card: 80)")
    c.add_argument("--peak-tflops", type=_number("--peak-tflops"),
                   help="dense bf16 peak per GPU, TFLOP/s (A100 312, H100 989)")
    c.add_argument("--utilisation", type=_number("--utilisation", high=1, high_open=False),
                   help="share of the peak large matrix products sustain (presets: 0.6)")
    c.add_argument("--attention-utilisation",
                   type=_number("--attention-utilisation", high=1, high_open=False),
                   help="share of the peak attention's products sustain (A100 0.5, H100 0.35)")
    c.add_argument("--intra-node-gbps", type=_number("--intra-node-gbps"),
                   help="GB/s per GPU inside a node, all-reduce bus bandwidth (A100 230, H100 450)")
    c.add_argument("--inter-node-gbps", type=_number("--inter-node-gbps"),
                   help="GB/s per GPU between nodes (one 200 Gb/s card: 20 in practice)")
    c.add_argument("--latency-us", type=_number("--latency-us"),
                   help="microseconds per message between nodes (presets: 10)")
    c.add_argument("--nvlink-latency-us", type=_number("--nvlink-latency-us"),
                   help="microseconds per message inside a node (presets: 5)")
    c.add_argument("--headroom", type=_number("--headroom", high=1, low_open=False),
                   help="share of each GPU's memory kept back for what is not counted "
                        "(presets: 0.1)")
    a = p.add_argument_group("what to answer")
    a.add_argument("--layout", help="price this layout instead of searching (keys below)")
    a.add_argument("--top", type=_whole("--top"), default=3,
                   help="how many of the fastest layouts to print (default 3)")
    a.add_argument("--max-tp", type=_whole("--max-tp"),
                   help="the largest tensor degree to try (default: the GPUs of a node)")
    return p


def _model(a) -> Model:
    if a.model != "custom" and a.model not in MODELS:
        raise Usage(f"unknown model {a.model!r}: use one of {', '.join(MODELS)}, or 'custom' "
                    f"with --layers, --d, --heads, --seq, --vocab and --batch")
    if a.model == "custom":
        missing = [f"--{k}" for k in MODEL_SIZES if getattr(a, k) is None]
        if missing:
            raise Usage(f"a custom model needs --layers, --d, --heads, --seq, --vocab and --batch "
                        f"({', '.join(missing)} missing)")
        model = Model("custom", *(getattr(a, k) for k in ("layers", "d", "heads", "seq", "vocab",
                                                           "batch")))
    else:
        model = MODELS[a.model]
    given = {k: getattr(a, k) for k in MODEL_SIZES if getattr(a, k) is not None}
    for arg, field in (("kv_heads", "kv_heads"), ("ffn", "hidden"), ("glu", "glu"),
                       ("tied", "tied"), ("bias", "bias"), ("dropout", "dropout"),
                       ("attention", "attention"), ("precision", "precision")):
        if getattr(a, arg) is not None:
            given[field] = getattr(a, arg)
    if a.model != "custom" and "kv_heads" not in given and "heads" in given \
            and given["heads"] % model.kv:
        given["kv_heads"] = 0      # the preset's key/value heads do not divide the new heads
    return replace(model, **given) if given else model


CLUSTER_ARGS = {"gpus": "gpus", "gpus_per_node": "gpus_per_node", "memory_gb": "memory_gb",
                "peak_tflops": "peak_flops", "utilisation": "utilisation",
                "attention_utilisation": "attention_utilisation",
                "intra_node_gbps": "intra_bandwidth", "inter_node_gbps": "inter_bandwidth",
                "latency_us": "inter_latency", "nvlink_latency_us": "intra_latency",
                "headroom": "headroom"}
SCALE = {"peak_flops": 1e12, "intra_bandwidth": 1e9, "inter_bandwidth": 1e9,
         "inter_latency": 1e-6, "intra_latency": 1e-6}
CUSTOM_NEEDS = ("gpus", "gpus_per_node", "memory_gb", "peak_tflops", "intra_node_gbps",
                "inter_node_gbps")


def _cluster(a) -> Cluster:
    given = {field: getattr(a, arg) * SCALE.get(field, 1) for arg, field in CLUSTER_ARGS.items()
             if getattr(a, arg) is not None}
    if a.cluster == "custom":
        missing = ["--" + k.replace("_", "-") for k in CUSTOM_NEEDS if getattr(a, k) is None]
        if missing:
            raise Usage(f"a custom cluster needs --gpus, --gpus-per-node, --gpu-memory-gb, "
                        f"--peak-tflops, --intra-node-gbps and --inter-node-gbps "
                        f"({', '.join(missing)} missing)")
        base = Cluster("custom", 1, 1, 1.0, 1.0, 0.6, 1.0, 5e-6, 1.0, 10e-6)
    elif a.cluster in HARDWARE:
        base = hardware_cluster(a.cluster, a.gpus or HARDWARE[a.cluster].gpus)
    elif a.cluster in CLUSTERS:
        base = CLUSTERS[a.cluster]
    else:
        raise Usage(f"unknown cluster {a.cluster!r}: use one of "
                    f"{', '.join(repr(k) for k in CLUSTERS)}, a GPU kind ({', '.join(HARDWARE)}) "
                    f"with --gpus, or 'custom'")
    cluster = replace(base, **given) if given else base
    if "gpus" in given and a.cluster != "custom":
        cluster = replace(cluster, name=f"{cluster.gpus} x {base.name.split(' ', 1)[-1]}")
    return cluster


def _header(model: Model, cluster: Cluster) -> list[str]:
    mlp = "SwiGLU" if model.glu else "GELU"
    kv = f", {model.kv} kv heads" if model.kv != model.heads else ""
    return [f"{model.name} ({model.parameters() / 1e9:.1f} B parameters) on {cluster.name}:",
            f"  {model.layers} layers, d {model.d}, {model.heads} heads{kv}, ffn {model.f} {mlp}, "
            f"vocab {model.vocab}, seq {model.seq}, batch {model.batch},",
            f"  {model.precision}, {model.attention} attention"
            f"{', tied embedding' if model.tied else ''}{', dropout' if model.dropout else ''}",
            f"  {cluster.gpus} GPUs, {cluster.gpus_per_node} per node, {cluster.memory_gb:g} GiB "
            f"({usable_bytes(cluster) / GB:.1f} GB usable), {cluster.peak_flops / 1e12:g} "
            f"TFLOP/s at {cluster.utilisation:.0%},",
            f"  NVLink {cluster.intra_bandwidth / 1e9:g} GB/s, network "
            f"{cluster.inter_bandwidth / 1e9:g} GB/s per GPU"]


def run(argv) -> int:
    a = build_parser().parse_args(argv)
    model, cluster = _model(a), _cluster(a)
    check_model(model)
    check_cluster(cluster)
    lines = _header(model, cluster)
    if a.layout is not None:
        lay = parse_layout(a.layout, cluster.gpus)
        best = [evaluate(model, cluster, lay)]
        lines.append(describe(best[0], model, cluster))
        if not best[0].fits:
            lines.append(f"    does not fit: {best[0].peak_memory / GB:.1f} GB of "
                         f"{usable_bytes(cluster) / GB:.1f} usable")
        print("\n".join(lines))
        return 0
    plans = search(model, cluster, max_tp=a.max_tp)
    best = plan(model, cluster, top=a.top, plans=plans)
    lines += [describe(p, model, cluster) for p in best]
    lines.append("why the other degrees lost (each with its best ZeRO stage, micro-batches, "
                 "checkpointing):")
    lines += ["    " + ln for ln in why_lost(best[0], model, cluster, plans=plans)]
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(x in ("-h", "--help") for x in argv):
        build_parser().print_help()
        return 0
    try:
        return run(argv)
    except (Usage, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
