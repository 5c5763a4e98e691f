"""Checks that a notebook prints and that fail loudly.

Every parallel result in the course is compared with a single-device baseline. ``check_close`` and
friends print one deterministic line when the comparison holds (nbval compares it) and raise
``CheckFailed`` with the numbers when it does not. The printed line names the tolerance, never the
measured difference, so it is the same on every machine.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["CheckFailed", "check", "check_close", "check_changed", "check_equal"]


class CheckFailed(AssertionError):
    """A claim the course makes did not hold on this run."""


def check(claim: str, ok: bool, detail: str = "") -> None:
    """Print ``OK  <claim>`` if ok, else raise CheckFailed with the detail."""
    if not ok:
        raise CheckFailed(f"FAILED  {claim}" + (f": {detail}" if detail else ""))
    print(f"OK  {claim}")


def _flatten(x: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(x, torch.nn.Module):
        x = x.state_dict()
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(x, (list, tuple)):
        out = {}
        for i, v in enumerate(x):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip(".") or "value": torch.as_tensor(x).detach().cpu()}


def _max_error(actual: Any, expected: Any, rtol: float, atol: float) -> tuple[float, str]:
    a, e = _flatten(actual), _flatten(expected)
    if a.keys() != e.keys():
        missing, extra = sorted(e.keys() - a.keys()), sorted(a.keys() - e.keys())
        raise CheckFailed(f"structures differ: missing {missing[:5]}, unexpected {extra[:5]}")
    worst, where = 0.0, ""
    for k in e:
        if a[k].shape != e[k].shape:
            raise CheckFailed(f"{k}: shape {tuple(a[k].shape)} != expected {tuple(e[k].shape)}")
        ak, ek = a[k].double(), e[k].double()
        excess = ((ak - ek).abs() - rtol * ek.abs()).max().item() if ek.numel() else 0.0
        if math.isnan(excess):  # a NaN anywhere is a failure, not a silent pass
            excess = math.inf
        if excess > worst or not where:
            worst, where = excess, k
    return worst, where


def check_close(claim: str, actual: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Check that tensors (or lists, dicts, state dicts, modules of them) agree within tolerance."""
    worst, where = _max_error(actual, expected, rtol, atol)
    ok = worst <= atol
    detail = f"at {where!r} |actual - expected| exceeds rtol*|expected| by {worst:.3g} > atol={atol:g}"
    check(f"{claim} (rtol={rtol:g}, atol={atol:g})", ok, detail)


def check_changed(claim: str, actual: Any, start: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Check that every tensor moved away from its starting value (beyond the given tolerance).

    Use it before ``check_close``: parallel equal to serial proves nothing if neither changed (a step
    that never ran, gradients that were all zero). The pair is "differ before, equal after".
    """
    a, s = _flatten(actual), _flatten(start)
    if a.keys() != s.keys():
        raise CheckFailed(f"structures differ: {sorted(a.keys() ^ s.keys())[:5]}")
    still = [k for k in s if torch.allclose(a[k].double(), s[k].double(), rtol=rtol, atol=atol)]
    check(f"{claim} (beyond rtol={rtol:g}, atol={atol:g})", not still,
          f"unchanged: {', '.join(still[:5])}")


def check_equal(claim: str, actual: Any, expected: Any) -> None:
    """Check exact equality of plain values (ints, strings, lists of them)."""
    check(claim, actual == expected, f"got {actual!r}, expected {expected!r}")
