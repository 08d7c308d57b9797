"""An offload that records the GEMMs a step hands it, and the tolerance bf16 jobs are held
to."""

from __future__ import annotations

import torch

from common.unfold import Unfold
from coordinator.step.executor import GemmDone

# bf16 keeps 8 significant bits: two correct bf16 steps that round their intermediates at
# different points (graph vs eager order, autocast's weight cache) give losses a few 1e-5
# apart, growing as training diverges; 1e-3 is a quarter of bf16's unit roundoff (2^-9)
# and still catches a wrong GEMM, which moves the loss by far more.
BF16_REL = 1e-3


class RecordingOffload:
    """Computes each GEMM on the calling thread, like a worker that answers at once, and
    records what was offloaded; hands all of its FLOPs to "workers"."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, torch.dtype]] = []
        self.flops = 0  # of every GEMM handed here, from the shapes it saw

    def start(
        self,
        name: str,
        op: str,
        a: torch.Tensor,
        b: torch.Tensor,
        done: GemmDone,
        unfold: Unfold | None = None,
    ) -> int:
        self.calls.append((name, "unfold_mm" if unfold else op, a.dtype))
        if unfold is not None:
            a, b = unfold.matrices(a, b)
        done(torch.bmm(a, b) if op == "bmm" else a @ b)
        flops = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if op == "bmm" else 1)
        self.flops += flops
        return flops
