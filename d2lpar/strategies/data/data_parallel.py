"""Data parallelism by hand, in one process: k devices, one model copy each, one global batch.

One training step with a global batch of B examples on k devices:

1. **scatter**: cut the batch into parts of b_1 + ... + b_k = B examples, one per device;
2. **replicate**: every device holds the same parameters (copied once at the start, then kept equal
   because every copy takes the same update);
3. **compute**: device i runs forward and backward on its part with the loss
   ``l_i = (1/B) * sum of the per-example losses of its b_i examples``, giving gradients g_i;
4. **all-reduce**: g = g_1 + ... + g_k on every device. Because each l_i is divided by the *global*
   B, g = (1/B) * sum over all B examples = the single-device gradient of the mean loss on the whole
   batch, for any split (even, balanced or proportional);
5. **update**: every device applies the same optimizer step to its copy.

So k devices with global batch B take exactly the steps one device takes with batch B (up to
floating-point rounding). Keeping the per-device batch fixed instead makes B = k * b: the step then
averages k times more examples, and the learning rate is usually raised with it (linear scaling).

**Gradient accumulation**: the global batch is processed in ``accumulation`` micro-batches whose
gradients add up before one update; with losses divided by the global B it is still the same step.
**Balanced split** (the source notes' ``BalancedDataParallel``): device 0 gets a smaller share
``gpu0_bsz`` (it also gathers outputs and holds the reduced gradients), the others share the rest.
**Proportional split**: ``weights`` proportional to each device's speed, for mixed GPUs.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from torch import nn

from d2lpar.infra.data import split_batch, split_sizes

__all__ = ["replicate", "gather", "allreduce_grads", "balanced_sizes",
           "micro_batch_sizes", "DataParallelSGD", "evaluate"]


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One independent copy of ``module`` per device (same parameters, separate storage)."""
    return [copy.deepcopy(module).to(d) for d in devices]


def gather(outputs: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Concatenate the outputs on one device (the ``output_device``)."""
    return torch.cat([o.to(device) for o in outputs if o is not None])


@torch.no_grad()
def allreduce_grads(replicas: Sequence[nn.Module]) -> int:
    """Sum every parameter's gradient over the replicas and give each replica the sum.

    The simplest all-reduce, notebook 04's one-device strategy: sum onto device 0, then copy the sum
    back to every replica. Returns the bytes copied: 2(k-1)K for K bytes of gradients.
    (``nn.DataParallel`` differs: it reduces onto device 0 and never copies gradients back; the
    next forward re-broadcasts the updated parameters instead.)
    """
    params = [list(r.parameters()) for r in replicas]
    moved = 0
    for group in zip(*params):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
        total = grads[0].clone()
        for g in grads[1:]:
            total += g.to(total.device)
            moved += g.numel() * g.element_size()
        for p in group:
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(total.to(p.device))
        moved += (len(group) - 1) * total.numel() * total.element_size()
    return moved


def balanced_sizes(batch_size: int, n: int, gpu0_bsz: int) -> list[int]:
    """Device 0 takes ``gpu0_bsz`` examples, the other n-1 devices share the rest evenly."""
    if n < 2:
        return [batch_size]
    if not 1 <= gpu0_bsz <= batch_size - (n - 1):
        raise ValueError(f"gpu0_bsz={gpu0_bsz} with a batch of {batch_size} on {n} devices: give "
                         f"device 0 between 1 and {batch_size - (n - 1)} examples so that every "
                         "other device gets at least one")
    return [gpu0_bsz] + split_sizes(batch_size - gpu0_bsz, n - 1)


def micro_batch_sizes(batch_size: int, accumulation: int) -> list[int]:
    """Sizes of the micro-batches a global batch is processed in (gradient accumulation)."""
    if accumulation < 1:
        raise ValueError(f"accumulation={accumulation}: use 1 (no accumulation) or more")
    return split_sizes(batch_size, accumulation)


class DataParallelSGD:
    """Train ``net`` on several devices by hand: scatter, compute, all-reduce, update.

    split: 'even' (default), 'balanced' (device 0 gets ``gpu0_bsz`` of each micro-batch) or
    'proportional' (``weights``, e.g. relative device speeds). ``accumulation`` micro-batches per
    step keep the global batch when a device's share must shrink.
    """

    def __init__(self, net: nn.Module, devices: Sequence[torch.device], lr: float,
                 loss: Callable | None = None, split: str = "even", gpu0_bsz: int | None = None,
                 weights: Sequence[float] | None = None, accumulation: int = 1,
                 momentum: float = 0.0):
        if split not in ("even", "balanced", "proportional"):
            raise ValueError(f"split={split!r}: use 'even', 'balanced' or 'proportional'")
        if split == "balanced" and gpu0_bsz is None:
            raise ValueError("split='balanced' needs gpu0_bsz: how many examples device 0 takes")
        if split == "proportional" and (weights is None or len(weights) != len(devices)):
            raise ValueError("split='proportional' needs one weight per device, e.g. their speeds")
        self.devices, self.split, self.gpu0_bsz = list(devices), split, gpu0_bsz
        self.weights, self.accumulation = weights, accumulation
        self.replicas = replicate(net, self.devices)
        self.optimizers = [torch.optim.SGD(r.parameters(), lr=lr, momentum=momentum)
                           for r in self.replicas]
        self.loss = loss or nn.CrossEntropyLoss(reduction="sum")
        self.bytes_reduced = 0

    def sizes(self, batch_size: int) -> list[int]:
        k = len(self.devices)
        if self.split == "balanced":
            return balanced_sizes(batch_size, k, self.gpu0_bsz)
        if self.split == "proportional":
            return split_sizes(batch_size, weights=self.weights)
        return split_sizes(batch_size, k)

    def step(self, X: torch.Tensor, y: torch.Tensor) -> float:
        """One update on the global batch (X, y); return its mean loss."""
        B, total = len(X), 0.0
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        for Xm, ym in zip(torch.split(X, micro_batch_sizes(B, self.accumulation)),
                          torch.split(y, micro_batch_sizes(B, self.accumulation))):
            xs, ys = split_batch(Xm, ym, self.devices, sizes=self.sizes(len(Xm)))
            for net, xi, yi in zip(self.replicas, xs, ys):
                if len(xi):
                    l_i = self.loss(net(xi), yi) / B  # divided by the GLOBAL batch size
                    l_i.backward()                    # adds to .grad: accumulation is free
                    total += l_i.item()
        self.bytes_reduced += allreduce_grads(self.replicas)
        for opt in self.optimizers:
            opt.step()
        return total

    @property
    def net(self) -> nn.Module:
        """The copy on device 0 (all copies are equal)."""
        return self.replicas[0]

    def in_sync(self) -> bool:
        """Whether every copy holds exactly the parameters of the first."""
        first = [p.detach().cpu() for p in self.replicas[0].parameters()]
        return all(torch.equal(a, b.detach().cpu()) for r in self.replicas[1:]
                   for a, b in zip(first, r.parameters()))


@torch.no_grad()
def evaluate(net: nn.Module, loader, device: torch.device | None = None) -> float:
    """Accuracy of ``net`` on a data loader."""
    device = device or next(net.parameters()).device
    net.eval()
    right = seen = 0
    for X, y in loader:
        right += (net(X.to(device)).argmax(1) == y.to(device)).sum().item()
        seen += len(y)
    net.train()
    return right / max(seen, 1)
