"""fp8 matrix products with per-tensor scales, as the numbers come out (the speed needs a GPU).

float8 e4m3 keeps 3 bits of mantissa and 4 of exponent: the largest value is 448 and the smallest
normal one 2^-6 (subnormals down to 2^-9). A tensor is sent to fp8 with a *scale*: s = amax / 448,
x8 = fp8(x / s), so that its largest entry lands at the top of the range and as few as possible
underflow; the product is then ``(a8 @ b8) * s_a * s_b``, which ``torch._scaled_mm`` computes with
the scales applied in higher precision (``out_dtype``). Without the scale (s = 1) values above 448
saturate and values below 2^-9 become 0. One outlier sets amax for the whole tensor, so every other
entry is quantised more coarsely: per-tensor scaling pays for outliers everywhere. ``rowwise=True``
gives each row of ``a`` (and each column of ``b``) its own scale, so an outlier coarsens only its
own row (torchao's float8 "rowwise" recipe; its default is tensorwise; DeepSeek-V3 scales 1x128
tiles of activations and 128x128 blocks of weights).

Where ``torch._scaled_mm`` is missing or refuses (some CPU builds without AVX-512 kernels),
``fp8_matmul`` computes the same product from the dequantised fp8 values (x8 * s, in fp32) and says
which ran in ``last_kernel``.

On a GPU ``_scaled_mm`` wants each dimension to be a multiple of 16 (the CPU is more lenient);
``fp8_matmul`` enforces the GPU's rule, so code written here runs there. An operand with an inf or
a nan is refused: its amax, so its per-tensor scale, would be inf or nan and every output nan
(fp32 keeps it to one row; with ``rowwise`` the row's or column's scale, so that row or column),
and e4m3 has no inf (unscaled, an inf saturates to 448, a finite number).
"""

from __future__ import annotations

import torch

__all__ = ["E4M3_MAX", "quantize", "fp8_matmul", "relative_error", "last_kernel"]

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)   # 448


last_kernel = ""   # which path the last fp8_matmul took


def quantize(x: torch.Tensor, scaled: bool = True, dim: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, s): fp8 e4m3 values and the fp32 scale with x ~ x8 * s; ``dim``: one scale per slice
    along the other dimension (amax over ``dim``, kept as size 1), None: one for the tensor."""
    if not scaled:
        s = torch.tensor(1.0)
    elif dim is None:
        s = (x.abs().max().float() / E4M3_MAX).clamp(min=1e-12)
    else:
        s = (x.abs().amax(dim, keepdim=True).float() / E4M3_MAX).clamp(min=1e-12)
    return (x.float() / s).to(torch.float8_e4m3fn), s


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, scaled: bool = True,
               out_dtype: torch.dtype = torch.bfloat16, rowwise: bool = False) -> torch.Tensor:
    """a @ b with both sides in fp8 e4m3 and the result in ``out_dtype``: per-tensor scales, or with
    ``rowwise`` one per row of a and one per column of b."""
    global last_kernel
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_matmul multiplies (m, k) by (k, n); got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    for name, size in (("m (rows of a)", a.shape[0]), ("k (columns of a, rows of b)", a.shape[1]),
                       ("n (columns of b)", b.shape[1])):
        if size % 16:
            raise ValueError(f"{name} = {size} must be a multiple of 16 for torch._scaled_mm (GPUs "
                             f"require it): pad it to {size + 16 - size % 16}")
    for name, t, line in (("a", a, "row"), ("b", b, "column")):
        bad = ~torch.isfinite(t)
        if bad.any():
            n, first = int(bad.sum()), tuple(bad.nonzero()[0].tolist())
            harm = ("unscaled, an inf saturates to 448, a finite number" if not scaled else
                    f"its {line}'s scale would be inf or nan, and so would that {line} of the "
                    f"output" if rowwise else
                    "a per-tensor scale of inf or nan turns every output into nan")
            raise ValueError(f"{name} has {n} {'entry that is' if n == 1 else 'entries that are'} "
                             f"inf or nan (the first at {first}): fp8 cannot carry it (e4m3 has no "
                             f"inf; {harm}); find where it came from, or skip the step as "
                             f"GradScaler does")
    a8, sa = quantize(a, scaled, 1 if rowwise and scaled else None)   # sa: (m, 1) rowwise
    b8, sb = quantize(b, scaled, 0 if rowwise and scaled else None)   # sb: (1, n) rowwise
    b8 = b8.t().contiguous().t()   # _scaled_mm wants its second operand column-major
    try:
        out = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        last_kernel = "torch._scaled_mm"
    except (AttributeError, NotImplementedError, RuntimeError):
        out = ((a8.float() * sa) @ (b8.float() * sb)).to(out_dtype)   # same values, dequantised
        last_kernel = "dequantised fp8 values, fp32 matmul"
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius)."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()
