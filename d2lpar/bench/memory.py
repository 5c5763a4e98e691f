"""``python -m d2lpar bench memory``: each memory lever measured against its formula.

Prints, for activation checkpointing on a stack of the course's transformer layers, the bytes saved
for backward / formula and the matmul FLOPs of a step / formula (none, full every 1 and 2 layers,
selective); the bytes per parameter of each precision recipe, measured from the tensors held / the
formula; and the fake-tensor dry run of an 8B-parameter model on 8 and 64 ranks (FSDP2) and on an
8 x 8 mesh (FSDP2 + TP): each category / formula, with the time each dry run took. Last line: the
ratio furthest from 1.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from d2lpar.cost import memory_levers as ML
from d2lpar.infra.autograd_meter import count_flops, saved_bytes
from d2lpar.strategies.memory.checkpointing import CheckpointedStack
from d2lpar.strategies.memory.dry_run import GPT, LLAMA_8B_LIKE, LLAMA_70B_LIKE, dry_run
from d2lpar.strategies.memory.precision import MixedPrecisionAdamW
from d2lpar.strategies.tensor.blocks import TransformerLayer


def checkpoint_rows(L=6, b=2, s=32, d=48, heads=4, hidden=192):
    x = torch.randn(b, s, d, requires_grad=True)
    rows = []
    for mode, k in (("none", 1), ("full", 1), ("full", 2), ("selective", 1)):
        torch.manual_seed(0)
        stack = CheckpointedStack([TransformerLayer(d, heads, hidden) for _ in range(L)], mode, k)
        got = saved_bytes(lambda: stack(x), stack)
        flops = count_flops(lambda: stack(x).square().sum().backward())
        want_flops = ML.step_flops(L, b, s, d, hidden) + ML.recompute_flops(mode, L, b, s, d, hidden, k)
        rows.append((f"{mode}, every {k}" if mode == "full" else mode,
                     got / ML.saved_bytes(mode, L, b, s, d, heads, hidden, k), flops / want_flops))
    return rows


def precision_rows():
    rows = []
    for kind, fp32_grads in (("bf16 mixed", False), ("bf16 mixed, fp32 grads", True)):
        opt = MixedPrecisionAdamW(nn.Linear(64, 64), fp32_grads=fp32_grads)
        for _ in range(2):   # the second backward ends with AdamW's moments in place
            opt.model(torch.randn(4, 64).bfloat16()).float().square().mean().backward()
            held = sum(opt.bytes_held().values()) / (64 * 65)
            if fp32_grads:
                opt.accumulate()
            opt.step()
        rows.append((kind, held / ML.bytes_per_parameter(kind)))
    return rows


def dry_run_rows(include_70b: bool):
    runs = [(LLAMA_8B_LIKE, (8,), "fsdp"), (LLAMA_8B_LIKE, (64,), "fsdp"), (LLAMA_8B_LIKE, (8, 8), "fsdp+tp")]
    if include_70b:
        runs.append((LLAMA_70B_LIKE, (64,), "fsdp"))
    rows = []
    for cfg, shape, plan in runs:
        r = dry_run(lambda: GPT(cfg), shape, plan, batch=1, seq=2048)
        want = ML.dry_run_formula(cfg.layers, cfg.d, cfg.heads, cfg.hidden, cfg.vocab, shape, 1, 2048)
        got = r.measured()
        rows.append((f"{r.parameters / 1e9:.1f}B {plan} {shape}", {k: got[k] / v for k, v in want.items()},
                     r.seconds))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m d2lpar bench memory", description=__doc__)
    parser.add_argument("--70b", dest="big", action="store_true", help="also dry-run the 70B model (~20 s)")
    args = parser.parse_args(argv)
    ratios = []
    print("activation checkpointing (6 layers): saved bytes / formula, step FLOPs / formula")
    for name, mem, flops in checkpoint_rows():
        print(f"  {name:<16} {mem:.3f}   {flops:.3f}")
        ratios += [mem, flops]
    print("bytes per parameter held / formula")
    for name, r in precision_rows():
        print(f"  {name:<24} {r:.3f}")
        ratios.append(r)
    print("fake-tensor dry run, rank 0: measured / formula per category")
    for name, per, seconds in dry_run_rows(args.big):
        print(f"  {name:<24} " + ", ".join(f"{k} {v:.3f}" for k, v in per.items()) + f"  ({seconds:.1f} s)")
        ratios += list(per.values())
    worst = max(ratios, key=lambda r: abs(r - 1))
    print(f"worst ratio: {worst:.4f}")
    return 0
