"""A small character-level GPT, written as a sequence of layers so that a pipeline can cut it anywhere.

    tokens (b, s) -> Embed: token + position vectors (b, s, d)
                  -> L x TransformerLayer (notebook 12's, causal: token i sees tokens 0..i)
                  -> Head: LayerNorm, Linear to the vocabulary (b, s, V) logits

The loss is the mean cross-entropy of predicting each next character. ``train_one_device`` is the
reference every parallel run of notebook 17 is checked against: the same batches, the same
optimizer, one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from d2lpar.strategies.tensor.blocks import TransformerLayer

__all__ = ["Embed", "Head", "char_gpt", "next_char_loss", "train_one_device", "gpt_sizes",
           "first_gradients"]


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)

    def forward(self, tokens):
        if tokens.shape[1] > self.pos.num_embeddings:
            raise ValueError(f"a sequence of {tokens.shape[1]} tokens is longer than the model's "
                             f"{self.pos.num_embeddings} positions: cut the batches to seq <= "
                             f"{self.pos.num_embeddings}")
        return self.tok(tokens) + self.pos.weight[: tokens.shape[1]]


class Head(nn.Module):
    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x):
        return self.out(self.norm(x))


def char_gpt(vocab: int, seq: int, layers: int = 4, d: int = 64, heads: int = 4,
             hidden: int | None = None, seed: int = 0) -> nn.Sequential:
    """Embed, ``layers`` causal transformer layers, Head: the same weights for a given seed."""
    torch.manual_seed(seed)
    return nn.Sequential(Embed(vocab, d, seq),
                         *[TransformerLayer(d, heads, hidden or 4 * d, causal=True) for _ in range(layers)],
                         Head(d, vocab))


def gpt_sizes(model: nn.Sequential) -> dict[str, int]:
    """layers, d, heads, hidden, vocab, seq of a ``char_gpt`` (what the planner's Model needs)."""
    emb, layer, head = model[0], model[1], model[-1]
    d = emb.tok.embedding_dim
    return {"layers": len(model) - 2, "d": d, "heads": d // layer.attn.head_dim,
            "hidden": layer.mlp.fc1.out_features, "vocab": head.out.out_features,
            "seq": emb.pos.num_embeddings}


def next_char_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of every sequence."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_one_device(model: nn.Module, batches, lr: float = 3e-3, every: int = 0) -> list[float]:
    """AdamW on each (X, Y) in turn, in this process (the model is changed); the losses.
    ``every``: print a progress line every that many steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for i, (X, Y) in enumerate(batches, 1):
        loss = next_char_loss(model(X), Y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if every and (i % every == 0 or i == len(batches)):
            print(f"  step {i} of {len(batches)}: loss {losses[-1]:.3f}", flush=True)
    return losses


def first_gradients(model: nn.Module, X: torch.Tensor, Y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradients of the batch's mean loss, before any optimizer step (the model is not changed)."""
    model.zero_grad(set_to_none=True)
    next_char_loss(model(X), Y).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads
