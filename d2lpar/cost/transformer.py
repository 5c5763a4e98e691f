"""A decoder-only transformer as the planner describes it: its parameters, FLOPs and saved
activations per layer, for the course's layer and for the layers people train.

The course's layer (notebook 12, ``d2lpar.strategies.tensor.blocks``): pre-LayerNorm, multi-head
attention, a two-matrix GELU MLP, biases, no dropout. The layers people train change four things,
each a field of ``Model``: grouped-query attention (``kv_heads`` < ``heads``: keys and values
``d_kv = d kv_heads / heads`` wide, Ainslie et al. 2023), a gated MLP (``glu``: SwiGLU's three
matrices, Shazeer 2020), no biases (``bias``), dropout (``dropout``), and FlashAttention
(``attention="flash"``, Dao et al. 2022) instead of the course's eager attention. With d the width,
f the MLP width, n = 3 matrices with ``glu`` (else 2), T tokens:

**Parameters of one layer**, split by Megatron's column/row cut (``p_split`` is cut in t, ``p_rest``
stays whole on every tensor rank): p_split = d (d + 2 d_kv) + d^2 + n d f (+ the column-parallel
biases d + 2 d_kv + (n - 1) f), p_rest = two norms (+ the row-parallel biases 2d). For the course's
layer this is ``memory_levers.split_parameters`` (a test keeps the two equal).

**Forward FLOPs of one layer** on T tokens attending to a context of c tokens:
2 T (d (d + 2 d_kv) + d^2 + n d f) for the matrix products, plus 4 T c d for attention's two batched
products (q k^T and the weighted sum of v); for the course's layer (T = bs, c = s) this is
``tp_cost.layer_flops``, 8bsd^2 + 4bs^2 d + 4bsdf. FlashAttention skips the blocks a causal mask
hides (half of 4 T c d) and its backward recomputes the scores: 5 products against the forward's 2
(Dao 2023, FlashAttention-2, section 3.1), 2.5 times the forward's attention FLOPs, not 2.

**Activation bytes one layer keeps** per micro-batch on one GPU, with tensor degree t, sequence
parallelism (sp), context degree cp (T = b s / cp local tokens) and e bytes per element:

    whole  e (2 + 1 + 1) T d  + 16 T  (+ 2 T d)   the norms' inputs, the qkv and fc1 inputs, the
                                                  norms' fp32 mean and 1/std (+ dropout's masks);
                                                  divided by t with sequence parallelism
    split  e T (d + 2 d_kv + d + n f) / t          q, k, v; the attention output (out's input);
                                                  the activation's input(s) and fc2's input
    core   eager: e b a T s (+ (1 + e) b a T s with dropout) / t, the softmax (and dropout's mask
           and output); flash: 4 b a T / t, the log-sum-exp per row

For the course's layer in fp32 this is ``tp_cost.activation_bytes`` (its fp32 formula, 4(4bsd + 4bs
+ (4bsd + 2bsf + bas^2)/t)); in 16 bits with dropout, less the norms' statistics, it is Korthikanti
et al. 2022's Table 2 (``tp_cost.korthikanti_bytes``): sbh(10 + 24/t + 5as/(ht)), and sbh/t(34 +
5as/h) with sequence parallelism. Tests keep all three equal. Checkpointing keeps less:

* ``selective`` (Korthikanti et al. 2022, section 4.2; Megatron-LM's ``--recompute-granularity
  selective``): the attention core recomputed, so ``core`` is not kept (nor recomputed by flash,
  which never stores it);
* ``matmuls`` (notebook 14's policy: save the outputs of the matrix products): the layer's input and
  the outputs of qkv, out, fc1, fc2; out's and fc2's are row-parallel, so full width on every tensor
  rank: e T (d / (t if sp) + (d + 2 d_kv)/t + d + (n - 1) f / t + d);
* ``full``: the layer's input only, e T d (over t with sequence parallelism);

and during the backward pass one layer at a time holds what it recomputed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["Model", "ATTENTIONS", "CHECKPOINTS", "PRECISIONS", "layer_parameters",
           "layer_flops_forward", "layer_activation_bytes", "check_model"]

ATTENTIONS = ("eager", "flash")
CHECKPOINTS = ("none", "selective", "matmuls", "full")

# bytes per parameter (weights, gradients, optimizer state: fp32 master weights and AdamW's two
# moments) and per activation value. "bf16-fp32-grads": the gradients accumulated (and reduced) in
# fp32, as Megatron-LM's main-gradient buffer does (Llama 3 too: section 3.3.2, "numerical
# stability"): 2 + 4 + 12 bytes.
PRECISIONS = {"bf16": {"param": 2, "grad": 2, "optimizer": 12, "act": 2},
              "bf16-fp32-grads": {"param": 2, "grad": 4, "optimizer": 12, "act": 2},
              "fp32": {"param": 4, "grad": 4, "optimizer": 8, "act": 4}}


@dataclass(frozen=True)
class Model:
    """A decoder: its sizes, its global batch (in sequences of ``seq`` tokens) and how it computes.

    The defaults describe the course's layer (multi-head attention, GELU MLP, biases, eager
    attention, untied embedding and output layer); ``d2lpar.cost.presets`` describes the models
    people train."""
    name: str
    layers: int
    d: int
    heads: int
    seq: int
    vocab: int
    batch: int                # global batch, in sequences
    hidden: int = 0           # MLP width f (0: 4 d)
    precision: str = "bf16"   # a key of PRECISIONS
    kv_heads: int = 0         # key/value heads (0: as many as heads; fewer: grouped-query)
    glu: bool = False         # a gated MLP (SwiGLU): three matrices instead of two
    tied: bool = False        # the output layer is the embedding's transpose
    bias: bool = True         # the linear layers have biases (and the norms a bias too)
    dropout: bool = False     # dropout after attention and the MLP (and on the attention scores)
    attention: str = "eager"  # 'eager' (the scores are stored) or 'flash'

    @property
    def f(self) -> int:
        return self.hidden or 4 * self.d

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @functools.cached_property
    def d_kv(self) -> int:
        """Width of the keys (and of the values): d kv_heads / heads."""
        return self.d * self.kv // self.heads

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.glu else 2

    def parameters(self) -> float:
        p_split, p_rest = layer_parameters(self)
        return self.layers * (p_split + p_rest) + self.embedding_parameters()

    def embedding_parameters(self) -> float:
        """The embedding, the output layer (unless tied) and the final norm."""
        norm = 2 * self.d if self.bias else self.d
        return (1 if self.tied else 2) * self.vocab * self.d + norm


def check_model(m: Model) -> None:
    """One sentence per impossible model."""
    for name in ("layers", "d", "heads", "seq", "vocab", "batch"):
        v = getattr(m, name)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"model {m.name!r}: {name}={v!r} must be a positive whole number")
    for name in ("hidden", "kv_heads"):
        v = getattr(m, name)
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"model {m.name!r}: {name}={v!r} must be a positive whole number "
                             f"(or 0 for the default)")
    if m.d % m.heads:
        raise ValueError(f"model {m.name!r}: the width d={m.d} does not divide into {m.heads} "
                         f"heads; give a width that is a multiple of the heads")
    if m.heads % m.kv:
        raise ValueError(f"model {m.name!r}: {m.kv} key/value heads do not divide the {m.heads} "
                         f"heads; give a divisor of {m.heads}")
    if m.precision not in PRECISIONS:
        raise ValueError(f"model {m.name!r}: precision={m.precision!r}: use one of "
                         f"{sorted(PRECISIONS)}")
    if m.attention not in ATTENTIONS:
        raise ValueError(f"model {m.name!r}: attention={m.attention!r}: use 'eager' or 'flash'")


@functools.lru_cache(maxsize=256)
def layer_parameters(m: Model) -> tuple[int, int]:
    """(p_split, p_rest) of one layer: the parameters Megatron's column/row cut divides over the
    tensor ranks, and those every tensor rank keeps whole."""
    d, dkv, f, n = m.d, m.d_kv, m.f, m.mlp_matrices
    p_split = d * (d + 2 * dkv) + d * d + n * d * f
    p_rest = 2 * (2 * d if m.bias else d)                  # two norms
    if m.bias:
        p_split += d + 2 * dkv + (n - 1) * f               # qkv's and fc1's (gate's, up's) biases
        p_rest += 2 * d                                    # out's and fc2's biases
    return p_split, p_rest


def layer_flops_forward(m: Model, tokens: float, context: float) -> tuple[float, float]:
    """(matrix products, attention's two batched products) of one layer's forward over ``tokens``
    tokens attending to ``context`` tokens each, counted in full (no causal skipping)."""
    d, dkv, f = m.d, m.d_kv, m.f
    mm = 2 * tokens * (d * (d + 2 * dkv) + d * d + m.mlp_matrices * d * f)
    return mm, 4 * tokens * context * d


def layer_activation_bytes(m: Model, b: float, s: int, t: int = 1, cp: int = 1, sp: bool = False,
                           checkpoint: str = "none", element: int | None = None) -> float:
    """Bytes one layer keeps for its backward, per micro-batch of b sequences of s tokens, on one
    GPU of a tensor group of t (sequence parallel: ``sp``) and a context group of cp (the module
    docstring's formula)."""
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint={checkpoint!r}: use one of {', '.join(CHECKPOINTS)}")
    e = element or PRECISIONS[m.precision]["act"]
    T = b * s / cp
    X = T * m.d
    cut = t if sp else 1
    if checkpoint == "full":
        return e * X / cut
    if checkpoint == "matmuls":
        return e * (X / cut + T * (m.d + 2 * m.d_kv) / t + X + (m.mlp_matrices - 1) * T * m.f / t
                    + X)
    whole = e * 4 * X + 16 * T + (2 * X if m.dropout else 0)
    split = e * T * (m.d + 2 * m.d_kv + m.d + m.mlp_matrices * m.f)
    act = whole / cut + split / t
    if m.attention == "flash":
        return act + 4 * m.heads * T / t
    if checkpoint == "none":
        act += m.heads * T * s * (e + (1 + e if m.dropout else 0)) / t
    return act
