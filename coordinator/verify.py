"""Freivalds' check of a returned tile: is ``c ≈ a @ b``?

For a random vector r, ``c r`` and ``a (b r)`` cost O(mk + kn + mn) instead of the
O(mkn) of the GEMM. Honest results differ from the check only by rounding, which is
bounded relative to ``|a| (|b| |r|)``; the tolerance scales with sqrt(k) (rounding
errors of a length-k dot product add up like a random walk) and the unit roundoff of
the tile's dtype. A wrong tile is off by far more than that for any random r.
"""

from __future__ import annotations

import math

import torch

UNIT_ROUNDOFF = {
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float64: 2.0**-53,
}
SAFETY = 4.0


def freivalds_ok(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, generator: torch.Generator | None = None
) -> bool:
    """True when ``c`` equals ``a @ b`` up to rounding. Works for 2-D and batched 3-D."""
    if c.shape != a.shape[:-1] + b.shape[-1:] or c.dtype != a.dtype:
        return False
    if c.numel() == 0:
        return True
    k = a.shape[-1]
    # fp32 for the check itself: its own rounding is far below the tile dtype's for
    # bf16/fp16 and comparable for fp32, which the sqrt(k) margin covers.
    work = torch.float64 if a.dtype == torch.float64 else torch.float32
    r = torch.randn(b.shape[-1], 1, dtype=work, generator=generator)
    a_w, b_w, c_w = a.to(work), b.to(work), c.to(work)
    if not torch.isfinite(c_w).all():
        return bool(not torch.isfinite(a_w).all() or not torch.isfinite(b_w).all())
    lhs = c_w @ r
    rhs = a_w @ (b_w @ r)
    scale = a_w.abs() @ (b_w.abs() @ r.abs())
    tol = SAFETY * (math.sqrt(k) + 2.0) * max(UNIT_ROUNDOFF[a.dtype], UNIT_ROUNDOFF[work]) * scale
    return bool(((lhs - rhs).abs() <= tol + 1e-30).all())
