"""How far an honest tile can be from the exact product: the check's rounding model.

The coordinator's check (``coordinator.tiles.verify``) compares ``c ρ`` with ``a (b ρ)`` for
secret vectors ρ, one statistic per output row and column chunk. An honest worker's
result differs from the exact product only by rounding, and this module gives an
upper estimate of that difference's variance for every statistic, from row norms of
the three matrices, and the threshold that an honest statistic exceeds with
probability below ``HONEST_REJECTION`` per tile.

The model, per output entry ``c_ij = Σ_l a_il b_lj`` accumulated by any honest kernel:

- every addition (or fused multiply-add) rounds its partial sum ``S_t`` by a relative
  error of at most the accumulation dtype's unit roundoff u, independently, with
  variance at most u²/3 (uniform on [-u, u]; real mantissas give about 0.18 u²);
- the summation order is unknown. A long recursive chain (one FMA after another, as
  GPU kernels and the microkernels of CPU BLAS run it) is the worst common order, and
  a blocked or pairwise one is better. For a chain of k terms whose order is not
  arranged against the data, ``Σ_t S_t²`` is on average ``k (c²/3 + Σ_l (a_il b_lj)²/6)``
  (a random walk pinned to its end point). ``ORDER_MARGIN`` doubles that, which also
  covers one dominant term at the front of the sum (a step instead of a walk).
- bf16/fp16 tiles accumulate in fp32 and round once to their dtype (oneDNN, cuBLAS with
  reduced-precision reductions off); subnormal values round in absolute steps of the
  subnormal spacing. fp32 kernels keep subnormals (``torch.set_flush_denormal(False)``,
  torch's default on CPU and CUDA); the bf16 dot-product instructions of AVX-512 and AMX
  flush subnormal products to zero whatever the setting, so for half-precision tiles
  every operation may also lose up to fp32's smallest normal number. That only matters
  for results near 1e-37, which are then checked no closer than that.

Row sums of ``Σ_l (a_il b_lj)²`` cost a pass over a squared copy of ``a``; where the
rows of ``b`` have similar norms the check bounds them by ``||a_i||² max_l ||b_l||²``
instead (exact for equal norms, loose but never unsafe otherwise).

The check's own arithmetic (fp32 for fp32, bf16 and fp16 tiles) rounds too, and it is
modelled the same way from its own chains: the column chunks and K blocks keep those
chains short, so they add little next to an honest worker's chain over all of K.

The threshold: a statistic sums independent rounding errors, but their variance is
itself random (a random walk's ``Σ S_t²`` fluctuates about its mean with an
exponential tail), so a statistic that one entry dominates has an exponential, not a
Gaussian, tail (docs/result-check.md has the measurement on a sequential fp32 kernel).
The threshold takes the larger of the Gaussian quantile and that exponential tail, for
the number of statistics in the tile. ``bench/calibrate_verify.py`` measures how far
below it honest products stay, kernel by kernel and value distribution by value
distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache
from statistics import NormalDist

import torch

HONEST_REJECTION = 1e-9  # the most an honest tile may be rejected, per tile
ORDER_MARGIN = 2.0  # on the random-walk estimate of Σ_t S_t²: unknown summation order
# Rate of the exponential tail of an honest statistic dominated by one chain, in units
# of the model's standard deviation with no margin: 2 sqrt((π²/12) / (6 η)) for a
# rounding-error variance of η u², η = 0.2 (0.18 for log-uniform mantissas).
TAIL_RATE = 2.0 * math.sqrt((math.pi**2 / 12) / (6 * 0.2))

UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def subnormal_spacing(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype honest kernels and the check sum in: fp64 for fp64 tiles, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class EntryRounding:
    """The honest rounding of one tile dtype: per output entry ``c_ij = Σ_l a_il b_lj``,
    the error variance is ``c_coefficient(k) c_ij² + terms_coefficient(k) Σ_l (a_il b_lj)²
    + absolute_per_entry(k)``."""

    u_acc: float  # unit roundoff of the accumulator
    u_out: float  # unit roundoff of the result's dtype where it is rounded once more
    spacing_acc: float  # subnormal spacing of the accumulator
    spacing_out: float  # subnormal spacing of the result's dtype
    flushed: float  # what an operation may lose to a flushed subnormal (half dtypes)

    @classmethod
    @cache
    def of(cls, dtype: torch.dtype) -> EntryRounding:
        acc = accumulation_dtype(dtype)
        return cls(
            u_acc=UNIT_ROUNDOFF[acc],
            u_out=0.0 if dtype == acc else UNIT_ROUNDOFF[dtype],
            spacing_acc=subnormal_spacing(acc),
            spacing_out=subnormal_spacing(dtype),
            flushed=0.0 if dtype == acc else torch.finfo(acc).smallest_normal,
        )

    def c_coefficient(self, k: int) -> float:
        # The k partial sums drift towards c (the walk's end point), then one rounding
        # to the result's dtype.
        return self.u_acc**2 / 3.0 * ORDER_MARGIN * k / 3.0 + self.u_out**2 / 3.0

    def terms_coefficient(self, k: int) -> float:
        # The walk's spread around that drift, and each product rounded where the
        # kernel does not fuse it into the addition.
        return self.u_acc**2 / 3.0 * (ORDER_MARGIN * k / 6.0 + 1.0)

    def absolute_per_entry(self, k: int) -> float:
        # Operations on subnormals round in absolute steps: k + 1 of the accumulator's
        # (or flush), one of the result's.
        per_operation = self.spacing_acc**2 / 12.0 + self.flushed**2 / 3.0
        return (k + 1) * per_operation + self.spacing_out**2 / 12.0


@lru_cache(maxsize=4096)
def threshold(statistics: int) -> float:
    """How many model standard deviations an honest statistic stays below: with
    ``statistics`` of them in a tile, all stay below it but with probability at most
    ``HONEST_REJECTION``, under a Gaussian tail and under the exponential tail of a
    statistic one chain dominates (the order margin scales that tail's rate)."""
    per_statistic = HONEST_REJECTION / max(1, statistics)
    gaussian = NormalDist().inv_cdf(1.0 - per_statistic / 2.0)
    exponential = math.log(1.0 / per_statistic) / (TAIL_RATE * math.sqrt(ORDER_MARGIN))
    return max(gaussian, exponential)
