"""Lower precision: what fp16 loses, what a gradient scaler gives back, and the bytes each recipe
holds.

**fp16** has 5 exponent bits: the smallest positive value is about 6e-8, so gradients smaller than
that become exactly 0 (they *underflow*). ``torch.amp.GradScaler`` multiplies the loss by a scale S
(2^16 at first) before backward, so every gradient is S times larger and representable, then divides
the gradients by S before the optimizer step. If any gradient overflowed (inf or nan), it *skips*
the step and halves S; after ``growth_interval`` clean steps it doubles S. **bf16** has fp32's 8
exponent bits (down to 1e-38): its gradients do not underflow, so it needs no scaler, only its 8-bit
mantissa's rounding is a cost.

**Mixed precision with fp32 master weights** (``MixedPrecisionAdamW``): the model computes in bf16
(2 bytes per parameter, 2 for its gradient), the optimizer keeps fp32 master weights (4) and AdamW's
two fp32 moments (8): 16 bytes per parameter when a backward ends, as much as fp32 training;
gradients accumulated over micro-batches in fp32 add 4 more (20). Inside ``step()`` AdamW reads fp32
gradients: a 4-byte copy of the bf16 ones (20 at that moment), or the fp32 buffers themselves, the
bf16 gradients already freed (18). Mixed precision saves activation memory and time, not the model's
state.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["grad_underflow", "ScalerRun", "train_with_scaler", "MixedPrecisionAdamW"]


def grad_underflow(model: nn.Module, X: torch.Tensor, y: torch.Tensor, loss_fn,
                   scale: float = 1.0) -> dict[str, int]:
    """Gradient entries that are 0 in an fp16-autocast backward (loss times ``scale``, gradients
    divided back) but not in fp32: {'fp32 zeros', 'fp16 zeros', 'entries'}."""
    def grads(autocast: bool, s: float):
        m = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            out = m(X)
        (loss_fn(out.float(), y) * s).backward()
        return torch.cat([p.grad.flatten() / s for p in m.parameters()])
    full, half = grads(False, 1.0), grads(True, scale)
    return {"fp32 zeros": int((full == 0).sum()), "fp16 zeros": int((half == 0).sum()),
            "entries": full.numel()}


class ScalerRun(list):
    """Per step: (step, scale used, skipped, loss)."""


def train_with_scaler(model: nn.Module, batches, loss_fn, lr: float = 0.1, dtype=torch.float16,
                      inf_at: set[int] = frozenset(), growth_interval: int = 4,
                      init_scale: float = 2.0 ** 16) -> ScalerRun:
    """SGD under fp16 autocast with a GradScaler; ``inf_at`` plants an inf in those steps' loss."""
    if dtype == torch.bfloat16:
        raise ValueError("bf16 needs no GradScaler: it has fp32's exponent range (down to about "
                         "1e-38), "
                         "so its gradients do not underflow; train bf16 without a scaler, or use "
                         "dtype=torch.float16 with one")
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    run = ScalerRun()
    for step, (X, y) in enumerate(batches):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            out = model(X)
        loss = loss_fn(out.float(), y)
        if step in inf_at:
            loss = loss * float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        used = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        run.append((step, used, skipped, loss.item()))
    return run


class MixedPrecisionAdamW:
    """A bf16 model trained through fp32 master weights: the recipe behind "16 bytes per parameter".

    ``step()`` takes the bf16 gradients (added into fp32 buffers first when ``fp32_grads``), runs
    ``torch.optim.AdamW`` on the fp32 masters, and copies them back into the bf16 model.
    """

    def __init__(self, model: nn.Module, lr: float = 1e-3, fp32_grads: bool = False):
        self.model = model.to(torch.bfloat16)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.accum = [torch.zeros_like(m) for m in self.master] if fp32_grads else None
        self.opt = torch.optim.AdamW(self.master, lr=lr)
        self.accumulated = False   # accumulate() ran since the last step

    def accumulate(self) -> None:
        """Move this micro-batch's bf16 gradients into the fp32 buffers (with ``fp32_grads``)."""
        if self.accum is None:
            raise ValueError("accumulate() moves gradients into fp32 buffers, which only "
                             "MixedPrecisionAdamW(..., fp32_grads=True) keeps")
        for p, acc in zip(self.params, self.accum):
            if p.grad is not None:
                acc += p.grad.float()
                p.grad = None
        self.accumulated = True

    def step(self) -> None:
        """AdamW on the fp32 masters, from fp32 gradients: the accumulation buffers themselves, or
        an fp32 copy of the bf16 gradients (alive while ``opt.step()`` runs, counted in
        ``bytes_at_step``); then the masters are copied into the bf16 model and every gradient is
        cleared for the next backward."""
        if not (self.accumulated if self.accum is not None else
                any(p.grad is not None for p in self.params)):
            raise ValueError("step() found no gradient: call loss.backward() before step() (and "
                             "accumulate() after each backward, with fp32_grads)")
        for p, m, i in zip(self.params, self.master, range(len(self.master))):
            if self.accum is not None:
                m.grad = self.accum[i]
            elif p.grad is not None:   # a parameter the loss did not reach: AdamW skips it
                m.grad = p.grad.float()
        self.bytes_at_step = self.bytes_held()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
                p.grad = None
        if self.accum is not None:
            for acc in self.accum:
                acc.zero_()
            self.accumulated = False
        for m in self.master:
            m.grad = None

    def bytes_held(self) -> dict[str, int]:
        """Bytes of each kind of tensor this rank holds now: call it when a backward has ended (the
        bf16 gradients exist) after a first step (AdamW's moments exist); ``step()`` records it
        while ``opt.step()`` runs, in ``bytes_at_step``."""
        def size(ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        state = [v for s in self.opt.state.values() for k, v in s.items() if k != "step"]
        out = {"bf16 weights": size(self.params),
               "bf16 gradients": size(p.grad for p in self.params),
               "fp32 master weights": size(self.master), "AdamW moments (fp32)": size(state)}
        if self.accum is not None:
            out["fp32 gradient buffers"] = size(self.accum)
        else:
            out["fp32 gradient copies"] = size(m.grad for m in self.master)
        return out
