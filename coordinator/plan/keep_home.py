"""Which GEMMs the coordinator computes itself because handing them out would cost it more
CPU than computing them (``serve --min-offload-intensity auto``, the default).

Handing a GEMM out costs the coordinator CPU for every byte it moves: cutting and
hashing the operands, signing and sending them, receiving and checking the result. A GEMM
computed here costs its FLOPs over the coordinator's own GEMM speed. Below the break-even
intensity, that speed times the CPU a byte costs, a GEMM is cheaper here than as tiles:
attention's products, whose short K gives them few FLOPs per byte.

The point of a pool is still that workers compute: what this keeps here is at most
``share`` of the GEMM FLOPs seen, the least intense first. A model whose every GEMM is
under break-even (a small one) still hands out nearly all of its work, and the operator
sees its workers busy.

A fixed intensity instead (``--min-offload-intensity F``) keeps every GEMM under it,
whatever its share; 0 keeps none.

Pure: no torch, no clock. Intensities are counted in quarter-octave bins, so a job whose
shapes change every step (data-dependent lengths) keeps a bounded table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.plan.planner import GemmShape

# The coordinator's CPU seconds per byte it moves (operands out and results back, every
# stage from cutting to checking): bench/bench_step.py's per-step breakdown, its stages
# but training and checkpoint over the step's MB down and up.
CPU_S_PER_BYTE = 1.3e-9
# The most of the GEMM FLOPs seen that the coordinator keeps for being cheaper here.
KEPT_SHARE = 0.05
BINS_PER_OCTAVE = 4


def intensity(shape: GemmShape) -> float:
    """FLOPs per byte the GEMM would move whole: operands out, result back."""
    moved = shape.operand_bytes + shape.output_bytes
    return shape.flops / moved if moved else math.inf


def _bin(value: float) -> int:
    """The quarter-octave bin of a positive intensity."""
    return math.floor(math.log2(value) * BINS_PER_OCTAVE)


@dataclass
class KeepHome:
    """Decides, GEMM by GEMM as a run goes, which stay here (not thread-safe: the
    training thread asks)."""

    below: float | None = None  # a fixed intensity; None: this machine's break-even
    cpu_s_per_byte: float = CPU_S_PER_BYTE
    share: float = KEPT_SHARE
    _flops: dict[int, int] = field(default_factory=dict)  # FLOPs seen, by intensity bin
    _total: int = 0

    def __post_init__(self) -> None:
        if self.below is not None and not self.below >= 0:
            raise ValueError("below must be >= 0")
        if not self.cpu_s_per_byte >= 0 or not 0 <= self.share <= 1:
            raise ValueError("cpu_s_per_byte must be >= 0 and share in [0, 1]")

    def keeps(self, shape: GemmShape, flops_per_s: Callable[[], float]) -> bool:
        """Whether the coordinator computes this GEMM itself. ``flops_per_s``: its own
        speed in the GEMM's dtype, asked only where the break-even decides. Without a
        fixed intensity, counts the GEMM among those seen either way."""
        if not shape.flops:
            return False  # nothing to weigh (an empty GEMM): the planner's call
        if self.below is not None:
            return intensity(shape) < self.below
        level = _bin(intensity(shape))
        self._flops[level] = self._flops.get(level, 0) + shape.flops
        self._total += shape.flops
        breakeven = flops_per_s() * self.cpu_s_per_byte
        if breakeven <= 0:
            return False
        return level < min(_bin(breakeven), self._first_over_budget())

    def _first_over_budget(self) -> int:
        """The lowest bin whose GEMMs, with all less intense ones, pass the budget:
        those below it are kept."""
        budget = self.share * self._total
        kept = 0
        for level in sorted(self._flops):
            kept += self._flops[level]
            if kept > budget:
                return level
        return 1 << 30
