"""What each device stores and sends in one training step, for each way of splitting the work.

Training keeps four kinds of tensors. For P parameters in fp32 (4 bytes each):

    parameters 4P,  gradients 4P,  optimizer state 4sP (s = 0 plain SGD, 1 momentum, 2 Adam),

and the *activations* autograd saves for the backward pass. For an MLP with widths d_0, ..., d_L,
each linear layer saves its input (a ReLU saves its output, which is the next layer's input, stored
once), so a batch of B samples keeps

    A = 4 B (d_0 + d_1 + ... + d_{L-1}) bytes.

``d2lpar.infra.activations.saved_activation_bytes`` measures A for any model by hooking autograd's
saved tensors; the notebook checks it against the formula. ``footprints`` then splits a step over n devices:

* data: every device holds the whole model and B/n samples; per step each device sends
  2 (n-1)/n * 4P bytes (a ring all-reduce of the gradients);
* model (layers): device i holds a contiguous group of layers (P_i parameters) and all B samples'
  activations of its layers; it sends the activations at its cut forward and their gradient back;
* pipeline: model parallelism with m micro-batches; same bytes, in m messages; GPipe keeps all
  micro-batches' activations, 1F1B at most n - i of them on stage i;
* channel: every layer's output channels are split n ways (the two-GPU AlexNet), P/n each; every
  device needs each layer's whole input, so each hidden layer's output is all-gathered (forward);
  backward, the gradient of that whole input is a partial sum on every device, and each device
  needs only its own slice of it (the gradient of its own outputs one layer down): a
  reduce-scatter, the backward of the all-gather. Per hidden width d: 2 (n-1)/n * 4 B d bytes;
  the last layer's output is all-gathered too (the loss needs all of it; each device then takes
  its own slice of the loss's gradient, with no message): (n-1)/n * 4 B d_L more;
* tensor (Megatron-LM): layers in (column, row) pairs; the inner activation stays split (each
  device keeps 1/n of it), the pair's input is whole on every device; one all-reduce of each pair's
  output forward, one of the gradient at each later pair's input backward (an even number of
  layers);
* data+model: d replicas of a k-stage model (n = d k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from d2lpar.comm.collectives import ring_rank_bytes, ring_rank_formula
from d2lpar.infra.data import split_sizes
from d2lpar.infra.partition import balanced_bounds

__all__ = ["mlp_activation_bytes", "Footprint", "footprints",
           "partition_layers", "STRATEGIES"]

BYTES = 4  # fp32
STRATEGIES = ("single", "data", "model", "pipeline-gpipe", "pipeline-1f1b", "channel", "tensor",
              "data+model")
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}


def mlp_activation_bytes(sizes: tuple[int, ...], batch: int) -> int:
    """The formula: 4 B (d_0 + ... + d_{L-1}) for an MLP with widths ``sizes`` = (d_0, ..., d_L)."""
    return BYTES * batch * sum(sizes[:-1])


def _layer_params(sizes) -> list[int]:
    return [a * b + b for a, b in zip(sizes[:-1], sizes[1:])]


def partition_layers(sizes: tuple[int, ...], parts: int) -> list[list[int]]:
    """Split the layers of an MLP into ``parts`` contiguous groups with balanced parameter counts."""
    params = _layer_params(sizes)
    if not 1 <= parts <= len(params):
        raise ValueError(f"cannot split {len(params)} layers into {parts} groups: use 1 to "
                         f"{len(params)} devices for model parallelism, or a deeper model")
    return [list(range(a, b)) for a, b in balanced_bounds(params, parts)]


@dataclass
class Footprint:
    """Bytes one device holds during a step, and bytes it sends per step."""
    strategy: str
    device: int
    params: int
    grads: int
    optimizer: int
    activations: int
    sent: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def footprints(sizes: tuple[int, ...], batch: int, n: int, strategy: str,
               optimizer: str = "adam", micro_batches: int = 4,
               replicas: int = 2) -> list[Footprint]:
    """Per-device memory and bytes sent for an MLP ``sizes`` trained with ``strategy`` on n
    devices."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose sgd, momentum or adam")
    if n < 1 or batch < n:
        raise ValueError(f"need n >= 1 devices and a batch of at least n samples "
                         f"(n={n}, B={batch})")
    s, lp = OPTIMIZER_STATES[optimizer], _layer_params(sizes)
    P, acts = sum(lp), [BYTES * d for d in sizes[:-1]]  # activations per sample, by layer

    def fp(i, p, act, sent):
        return Footprint(strategy, i, BYTES * p, BYTES * p, s * BYTES * p, int(act), int(sent))

    if strategy == "single" or n == 1:
        return [fp(0, P, batch * sum(acts), 0)]
    if strategy == "data":
        return [fp(i, P, b * sum(acts), ring_rank_formula(BYTES * P, n))
                for i, b in enumerate(split_sizes(batch, n))]
    if strategy == "channel":
        out = []
        for i in range(n):
            p = sum((a * b + b) // n + (i < (a * b + b) % n) for a, b in zip(sizes[:-1], sizes[1:]))
            # forward: all-gather each hidden output; backward: reduce-scatter its gradient
            gather = sum(ring_rank_bytes("all_gather", BYTES * batch * d, n) for d in sizes[1:-1])
            scatter = sum(ring_rank_bytes("reduce_scatter", BYTES * batch * d, n)
                          for d in sizes[1:-1])
            final = ring_rank_bytes("all_gather", BYTES * batch * sizes[-1], n)  # for the loss
            out.append(fp(i, p, batch * sum(acts), gather + scatter + final))
        return out
    if strategy == "tensor":
        L = len(sizes) - 1
        if L % 2:
            raise ValueError(f"tensor parallelism pairs the layers: {L} layers is odd")
        out = []
        for i in range(n):
            p = 0
            for j, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                if j % 2 == 0:   # column: weight and bias split by output
                    p += (a * b + b) // n + (i < (a * b + b) % n)
                else:            # row: weight split by input rows, bias whole on every device
                    p += (a * b) // n + (i < (a * b) % n) + b
            act = batch * sum(acts[j] if j % 2 == 0 else acts[j] / n for j in range(L))
            sent = sum(ring_rank_bytes("all_reduce", BYTES * batch * sizes[j], n)
                       * (2 if j < L else 1) for j in range(2, L + 1, 2))
            out.append(fp(i, p, act, sent))
        return out
    d = replicas if strategy == "data+model" else 1
    if n % d:
        raise ValueError(f"data+model needs n divisible by replicas "
                         f"({n} devices, {replicas} replicas)")
    k = n // d
    groups = partition_layers(sizes, k)
    out = []
    for r, b in enumerate(split_sizes(batch, d)):
        for g, layers in enumerate(groups):
            p = sum(lp[j] for j in layers)
            act = b * sum(acts[j] for j in layers)
            if strategy == "pipeline-1f1b":
                act = act * min(micro_batches, k - g) / micro_batches
            sent = (BYTES * b * sizes[layers[-1] + 1] if g < k - 1 else 0) + \
                   (BYTES * b * sizes[layers[0]] if g > 0 else 0)
            if d > 1:
                sent += ring_rank_formula(BYTES * p, d)
            out.append(fp(r * k + g, p, act, sent))
    return out
