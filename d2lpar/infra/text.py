"""A text to train a character-level language model on, made here (nothing to download), and its batches.

``make_text`` writes sentences from a small grammar ("the old miller carries a lantern across the
bridge.") with a seeded random generator, so every machine makes the same characters. The grammar
gives the text structure a model can learn (spelling, then which words follow which), and is small
enough that a few-layer GPT's loss falls within a few dozen steps. ``CharCorpus`` maps characters to ids; ``batches`` cuts
windows of ``seq + 1`` characters: the first ``seq`` are the input, the last ``seq`` the targets
(each position predicts the next character).
"""

from __future__ import annotations

import random

import torch

__all__ = ["make_text", "CharCorpus", "batches"]

_SUBJECTS = ["the miller", "the old sailor", "a young clerk", "the baker", "my sister", "the captain",
             "a tired horse", "the small boy", "our neighbour", "the quiet student"]
_VERBS = ["carries", "finds", "paints", "watches", "mends", "sells", "follows", "remembers",
          "loses", "counts"]
_OBJECTS = ["a lantern", "the letters", "an old map", "the bread", "a red boat", "the garden gate",
            "seven apples", "the clock", "a wooden box", "the river stones"]
_PLACES = ["across the bridge", "in the morning", "near the harbour", "after the rain",
           "behind the mill", "before supper", "along the road", "under the oak tree"]


def make_text(chars: int = 60_000, seed: int = 0) -> str:
    """About ``chars`` characters of generated sentences, one per line, the same for a given seed."""
    if chars < 1:
        raise ValueError(f"chars={chars}: ask for at least one character")
    rng, lines, n = random.Random(seed), [], 0
    while n < chars:
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        if rng.random() < 0.6:
            words.append(rng.choice(_PLACES))
        line = " ".join(words) + "."
        lines.append(line)
        n += len(line) + 1
    return "\n".join(lines)[:chars]


class CharCorpus:
    """A text and its alphabet: ``encode`` gives ids (a LongTensor), ``decode`` gives the text back."""

    def __init__(self, text: str):
        if not text:
            raise ValueError("the text is empty: give at least two characters")
        self.text, self.chars = text, sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.ids = self.encode(text)

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        unknown = sorted(set(s) - set(self.index))
        if unknown:
            raise ValueError(f"characters {unknown!r} are not in the corpus's alphabet")
        return torch.tensor([self.index[c] for c in s], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def batches(ids: torch.Tensor, batch: int, seq: int, steps: int, seed: int = 0):
    """``steps`` pairs (X, Y) of shape (batch, seq): random windows of the text, Y one character on."""
    if len(ids) <= seq + 1:
        raise ValueError(f"a text of {len(ids)} characters holds no window of seq+1={seq + 1}: use a "
                         f"shorter seq or a longer text")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, len(ids) - seq - 1, (batch,), generator=g)
        window = torch.stack([ids[s:s + seq + 1] for s in start.tolist()])
        out.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))
    return out
