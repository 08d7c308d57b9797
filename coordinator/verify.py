"""Freivalds' check of a returned tile: is ``c ≈ a @ b``?

For a random vector r, ``c r`` and ``a (b r)`` cost O(mk + kn + mn) instead of the
O(mkn) of the GEMM. Honest results differ from the check only by rounding, which is
bounded relative to ``|a| (|b| |r|)``; the tolerance scales with sqrt(k) (rounding
errors of a length-k dot product add up like a random walk) and the unit roundoff of
the tile's dtype. A wrong tile is off by far more than that for any random r.
"""

from __future__ import annotations

import math
import secrets

import torch

UNIT_ROUNDOFF = {
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float64: 2.0**-53,
}
SAFETY = 4.0


def new_generator() -> torch.Generator:
    """A private, unpredictable source of check vectors.

    Never the global RNG: that one is predictable from the job's seed (a cheater could
    craft results that pass) and drawing from it would shift the training's own random
    stream (dropout masks).
    """
    return torch.Generator().manual_seed(secrets.randbits(63))


def check_vector(n: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A secret [n, 1] vector with entries of random sign and magnitude in [1, 2).

    Bounded away from zero, so an error in any single entry of c moves ``c r`` by at
    least its own size: a wrong entry larger than the rounding tolerance is caught on
    every check, not just with high probability (a Gaussian r would sometimes put a
    near-zero weight on exactly the entry that is wrong).
    """
    magnitude = 1.0 + torch.rand(n, 1, dtype=dtype, generator=generator)
    sign = torch.randint(0, 2, (n, 1), generator=generator).to(dtype) * 2.0 - 1.0
    return magnitude * sign


def freivalds_ok(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, generator: torch.Generator
) -> bool:
    """True when ``c`` equals ``a @ b`` up to rounding. Works for 2-D and batched 3-D.

    Honest tiles accumulate in at least fp32 (CPU kernels do for bf16/fp16 too) and
    round once to the tile's dtype at the end, so the tolerance has three parts: fp32
    accumulation error growing like sqrt(k) relative to ``|a| (|b| |r|)``, one output
    rounding relative to ``|c| |r|``, and the dtype's smallest spacing for products
    that land among subnormals.
    """
    if c.shape != a.shape[:-1] + b.shape[-1:] or c.dtype != a.dtype:
        return False
    if c.numel() == 0:
        return True
    work = torch.float64 if a.dtype == torch.float64 else torch.float32
    a_w, b_w, c_w = a.to(work), b.to(work), c.to(work)
    if not torch.isfinite(c_w).all():
        # Only a step that has already blown up (inf/NaN operands) has honest
        # non-finite products; such a tile cannot be checked, and it does not matter.
        return bool(not torch.isfinite(a_w).all() or not torch.isfinite(b_w).all())
    r = check_vector(b.shape[-1], work, generator)
    lhs = c_w @ r
    rhs = a_w @ (b_w @ r)
    r_abs = r.abs()
    accumulation = (
        (math.sqrt(a.shape[-1]) + 2.0) * UNIT_ROUNDOFF[work] * (a_w.abs() @ (b_w.abs() @ r_abs))
    )
    u_out = UNIT_ROUNDOFF[a.dtype]
    output_rounding = u_out * (c_w.abs() @ r_abs)
    tiny = torch.finfo(a.dtype).smallest_normal * u_out * float(r_abs.sum())
    tol = SAFETY * (accumulation + output_rounding + tiny)
    return bool(((lhs - rhs).abs() <= tol).all())
