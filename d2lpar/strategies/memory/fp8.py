"""fp8 matrix products with per-tensor scales, as the numbers come out (the speed needs a GPU).

float8 e4m3 keeps 3 bits of mantissa and 4 of exponent: the largest value is 448 and the smallest
normal one 2^-6 (subnormals down to 2^-9). A tensor is sent to fp8 with a *scale*: s = amax / 448,
x8 = fp8(x / s), so that its largest entry lands at the top of the range and as few as possible
underflow; the product is then ``(a8 @ b8) * s_a * s_b``, which ``torch._scaled_mm`` computes with
the scales applied in higher precision (``out_dtype``). Without the scale (s = 1) values above 448
saturate and values below 2^-9 become 0. One outlier sets amax for the whole tensor, so every other
entry is quantised more coarsely: per-tensor scaling pays for outliers everywhere, which is why
recipes scale per row or per block too.

On a GPU ``_scaled_mm`` wants each dimension to be a multiple of 16 (the CPU is more lenient);
``fp8_matmul`` enforces the GPU's rule, so code written here runs there.
"""

from __future__ import annotations

import torch

__all__ = ["E4M3_MAX", "quantize", "fp8_matmul", "relative_error"]

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)   # 448


def quantize(x: torch.Tensor, scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, s): fp8 e4m3 values and the fp32 scale with x ~ x8 * s."""
    s = (x.abs().max().float() / E4M3_MAX).clamp(min=1e-12) if scaled else torch.tensor(1.0)
    return (x.float() / s).to(torch.float8_e4m3fn), s


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, scaled: bool = True,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a @ b with both sides in fp8 e4m3 (per-tensor scales) and the result in ``out_dtype``."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_matmul multiplies (m, k) by (k, n); got {tuple(a.shape)} and {tuple(b.shape)}")
    for name, size in (("m (rows of a)", a.shape[0]), ("k (columns of a, rows of b)", a.shape[1]),
                       ("n (columns of b)", b.shape[1])):
        if size % 16:
            raise ValueError(f"{name} = {size} must be a multiple of 16 for torch._scaled_mm (GPUs "
                             f"require it): pad it to {size + 16 - size % 16}")
    a8, sa = quantize(a, scaled)
    b8, sb = quantize(b, scaled)
    b8 = b8.t().contiguous().t()   # _scaled_mm wants its second operand column-major
    return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius)."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()
