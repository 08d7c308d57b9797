"""How a training step's GEMMs are named: "s<step>:<node>", the step counted from 0.

The trainer labels each step with ``step_label`` and the executors prefix every GEMM's
name with it, so every GEMM of a run has its own name, and the same GEMM has the same
name when its step runs again after a restart (coordinator.pool.payouts relies on that).
A traced step's GEMMs are named for their graph's nodes; an eager step's (``eager_name``)
for their op and order, so the offload can tell which of the two ran them.
"""

from __future__ import annotations

import re

_STEP = re.compile(r"s(\d+):")
_EAGER = "eager_"  # no node of a traced graph is named so: they are named for their ops


def step_label(step: int) -> str:
    """The prefix of the names of step ``step``'s GEMMs."""
    return f"s{step}"


def step_of(gemm_id: str) -> int | None:
    """The training step a GEMM belongs to, or None for a GEMM of no step."""
    found = _STEP.match(gemm_id)
    return int(found.group(1)) if found else None


def eager_name(label: str, op: str, count: int) -> str:
    """The name of an eager step's ``count``-th GEMM (op ``op``) in step ``label``."""
    return f"{label}:{_EAGER}{op}_{count}"


def traced(gemm_id: str) -> bool:
    """Whether a GEMM of a step is a node of its traced graph: only torch's own ops run
    between such GEMMs, so no tensor's bytes change without its version moving on (user
    code does run between an eager step's GEMMs)."""
    return step_of(gemm_id) is not None and not gemm_id.partition(":")[2].startswith(_EAGER)
