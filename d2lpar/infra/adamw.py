"""AdamW written out: every operation is elementwise, so it runs unchanged on any shard of a tensor.

For a parameter w with gradient g, step t, learning rate lr and weight decay lambda (decoupled from
the gradient, Loshchilov and Hutter):

    w <- w (1 - lr lambda)
    m <- beta1 m + (1 - beta1) g              v <- beta2 v + (1 - beta2) g^2
    w <- w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Element i of the new w depends only on element i of w, g, m and v. That is why ZeRO can give each rank
one slice of the flat parameters with the same slice of m and v (8 of Adam's 16 bytes per parameter in
fp32) and update only that slice: the result is bit-for-bit the slice of the full update. The
operations follow ``torch.optim.AdamW``'s single-tensor path in the same order, so the two agree to
the last bits of fp32, and a test checks it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["AdamW"]


def check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    """torch.optim.AdamW's ranges, with nan and inf refused too (a nan learning rate trains to nan)."""
    def ok(x, top=math.inf):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < top
    if not (ok(lr) and ok(eps) and ok(weight_decay) and len(tuple(betas)) == 2
            and all(ok(b, 1) for b in betas)):
        raise ValueError(f"AdamW needs finite lr >= 0, eps >= 0, weight_decay >= 0 and two betas in "
                         f"[0, 1); got lr={lr}, betas={tuple(betas)}, eps={eps}, "
                         f"weight_decay={weight_decay}")


class AdamW:
    """``AdamW(params, lr, betas, eps, weight_decay)``; ``step()`` updates each p from p.grad in place.

    ``state[i]`` holds ``step``, ``exp_avg`` (m) and ``exp_avg_sq`` (v) of the i-th tensor, created at
    its first step, as torch does; parameters whose ``.grad`` is None are skipped.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        self.params = list(params)
        check_hyperparameters(lr, betas, eps, weight_decay)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.state: dict[int, dict] = {}

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            s = self.state.setdefault(i, {"step": 0, "exp_avg": torch.zeros_like(p),
                                          "exp_avg_sq": torch.zeros_like(p)})
            s["step"] += 1  # counted per tensor, as torch does
            t = s["step"]
            p.mul_(1 - self.lr * self.weight_decay)
            s["exp_avg"].lerp_(g, 1 - beta1)
            s["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            step_size = self.lr / (1 - beta1 ** t)
            denom = (s["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** t)).add_(self.eps)
            p.addcdiv_(s["exp_avg"], denom, value=-step_size)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state held: m and v of every tensor stepped so far."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))
