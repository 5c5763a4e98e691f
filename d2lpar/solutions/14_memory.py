"""Worked solutions to the exercises of notebook 14 (memory)."""

import math

import torch

from d2lpar.cost import memory_levers as ML
from d2lpar.infra.autograd_meter import saved_bytes
from d2lpar.strategies.memory.checkpointing import MATMULS, CheckpointedStack
from d2lpar.strategies.memory.dry_run import LLAMA_8B_LIKE
from d2lpar.strategies.tensor.blocks import TransformerLayer

B, S, D, HEADS, HIDDEN = 2, 16, 32, 4, 128


def exercise_1():
    """The first depth at which sqrt-spaced checkpoints keep under a tenth of the activations."""
    X, A = ML.input_bytes(B, S, D), ML.layer_activations(B, S, D, HEADS, HIDDEN)
    for L in range(1, 10_000):
        k = max(1, math.floor(ML.best_spacing(L, X, A)))
        if ML.checkpoint_peak(L, k, X, A) < 0.1 * L * A:
            break
    print(f"X = {X}, A = {A:.0f}: from L = {L} layers (k = {k}), the peak is "
          f"{ML.checkpoint_peak(L, k, X, A) / (L * A):.3f} of L A")
    # M(k*) / (L A) = 2 sqrt(X / (L A)) when k* is whole: under 0.1 once L > 400 X / A
    assert L <= math.ceil(400 * X / A) + 5 and ML.checkpoint_peak(L, k, X, A) < 0.1 * L * A
    return L


def exercise_2():
    """Saving the attention's batched products too: their outputs are kept, nothing is recomputed."""
    L = 8
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(0)
    stack = CheckpointedStack([TransformerLayer(D, HEADS, HIDDEN) for _ in range(L)], "selective",
                              save_ops=MATMULS + (torch.ops.aten.bmm.default,))
    got = saved_bytes(lambda: stack(x), stack)
    # the scores q k^T (b a s s) and the weighted values (b a s dh = b s d) join the saved outputs
    want = ML.saved_bytes("selective", L, B, S, D, HEADS, HIDDEN) + L * 4 * (B * HEADS * S * S + B * S * D)
    print(f"saved with bmm kept: {got:,} bytes (formula {want:,}); the matmul FLOPs recomputed: 0 "
          "(softmax and the division are not matmuls)")
    assert got == want
    return got


def exercise_3():
    """Sequences of 2,048 tokens per 80 GB GPU, 8B model, FSDP2 on 64 GPUs."""
    c = LLAMA_8B_LIKE
    one = ML.dry_run_formula(c.layers, c.d, c.heads, c.hidden, c.vocab, (64,), 1, 2048)
    two = ML.dry_run_formula(c.layers, c.d, c.heads, c.hidden, c.vocab, (64,), 2, 2048)
    per_sequence = two["act"] - one["act"]
    fixed = one["sharded_param"] + one["sharded_grad"] + one["opt"] + one["unsharded_param"] + one["all_gather"]
    fits = int((80e9 - fixed - (one["act"] - per_sequence)) // per_sequence)
    print(f"fixed {fixed / 1e9:.1f} GB, {per_sequence / 1e9:.1f} GB of activations per sequence: "
          f"{fits} sequence(s) fit in 80 GB")
    assert fits >= 1 and fixed + fits * per_sequence <= 80e9
    return fits
