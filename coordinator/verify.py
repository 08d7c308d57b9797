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

    The check is memory-bound (matrix-vector products), so it reads each matrix as few
    times as it can: the tolerance uses row 2-norms, which need no ``|a|`` copy, and
    bounds ``|a| (|b| |r|)`` by Cauchy-Schwarz, ``||a_i|| * ||2 sqrt(n) ||b_l|| ||``
    (``|r| <= 2``). On weight-like data that is ~2x the exact sum: wrong entries must
    be ~2x larger to be caught than with the exact bound, at a third of the cost.
    """
    if c.shape != a.shape[:-1] + b.shape[-1:] or c.dtype != a.dtype:
        return False
    if c.numel() == 0:
        return True
    work = torch.float64 if a.dtype == torch.float64 else torch.float32
    a_w, b_w, c_w = a.to(work), b.to(work), c.to(work)  # no copies for fp32
    r = check_vector(b.shape[-1], work, generator)  # [n, 1], |r| in [1, 2)
    lhs = c_w @ r  # [.., m, 1]
    if not torch.isfinite(lhs).all():
        # Only a step that has already blown up (inf/NaN operands) has honest
        # non-finite products; such a tile cannot be checked, and it does not matter.
        return bool(not torch.isfinite(a_w).all() or not torch.isfinite(b_w).all())
    rhs = a_w @ (b_w @ r)  # [.., m, 1]
    # Only 2-norms: torch's row 2-norm runs at memory speed, its 1-norm ~4x slower.
    # ||x||_1 <= sqrt(len) ||x||_2, and |r| <= 2.
    n = b.shape[-1]
    root_n = math.sqrt(n)
    b_rows = 2.0 * root_n * torch.linalg.vector_norm(b_w, dim=-1)  # [.., k] >= |b| |r|
    a_rows = torch.linalg.vector_norm(a_w, dim=-1)  # [.., m]
    accumulation = (
        (math.sqrt(a.shape[-1]) + 2.0)
        * UNIT_ROUNDOFF[work]
        * a_rows
        * torch.linalg.vector_norm(b_rows, dim=-1, keepdim=True)
    )  # [.., m] >= the same bound on |a| (|b| |r|)
    u_out = UNIT_ROUNDOFF[a.dtype]
    output_rounding = u_out * 2.0 * root_n * torch.linalg.vector_norm(c_w, dim=-1)  # [.., m]
    tiny = torch.finfo(a.dtype).smallest_normal * u_out * 2.0 * n
    tol = SAFETY * (accumulation + output_rounding + tiny)
    return bool(((lhs - rhs).abs().squeeze(-1) <= tol).all())
