"""How a training step's GEMMs are named: "s<step>:<node>", the step counted from 0.

The trainer labels each step with ``step_label`` and the executors prefix every GEMM's
name with it, so every GEMM of a run has its own name, and the same GEMM has the same
name when its step runs again after a restart (coordinator.pool.payouts relies on that).
"""

from __future__ import annotations

import re

_STEP = re.compile(r"s(\d+):")


def step_label(step: int) -> str:
    """The prefix of the names of step ``step``'s GEMMs."""
    return f"s{step}"


def step_of(gemm_id: str) -> int | None:
    """The training step a GEMM belongs to, or None for a GEMM of no step."""
    found = _STEP.match(gemm_id)
    return int(found.group(1)) if found else None
