"""Each GEMM of a training step pays out its FLOPs once, however often the step runs.

A coordinator that crashes resumes from its last complete checkpoint, so the steps after
that checkpoint, and the step that was in flight, run again: their GEMMs are cut and
handed out again, and workers verify the same work a second time. The first results are
lost with the crash, but their credit is not: it was committed as each tile was
verified. So the ledger journals what each GEMM of a step has paid (a ``Payout``), in
the same transaction as the credit itself, and when the step runs again its tiles are
credited only what their GEMM has not paid yet: the first tiles verified the second time
are paid what the lost ones of the first time did not get, the rest nothing. No GEMM of
a step pays out more than its FLOPs, and no verified credit is taken back.

The journal holds a row per GEMM, not per tile (a step has hundreds of GEMMs and may have
many thousands of tiles, and the planner may cut a GEMM differently the second time, for
other workers). Payouts of the steps a checkpoint covers can never be needed again and
are forgotten. Tiles whose GEMM names no training step (the load bench's, the
simulator's) or has no size are credited as they come and journaled nowhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from coordinator.schedule.records import TileTicket
from coordinator.step.gemm_names import step_of


@dataclass(frozen=True)
class Payout:
    """FLOPs a GEMM of a training step paid out: a journal row, or what a commit adds."""

    scope: str  # whose steps: one coordinator rank's (ranks of a job share a store)
    step: int
    gemm: str
    flops: int


class Payouts:
    """What the GEMMs of the steps no checkpoint covers yet have paid, in one scope."""

    def __init__(self, scope: str, paid: Iterable[Payout] = ()) -> None:
        self.scope = scope
        self._paid: dict[str, Payout] = {}
        for payout in paid:
            self._add(payout)

    def paid(self, gemm_id: str) -> int:
        payout = self._paid.get(gemm_id)
        return payout.flops if payout is not None else 0

    def pay(self, ticket: TileTicket) -> tuple[int, Payout | None]:
        """What a verified tile is credited, and the payout to journal for it (None:
        nothing to journal)."""
        step = step_of(ticket.gemm_id)
        if step is None or ticket.gemm_flops <= 0:
            return ticket.flops, None
        owed = ticket.gemm_flops - self.paid(ticket.gemm_id)
        flops = max(0, min(ticket.flops, owed))
        if flops == 0:
            return 0, None
        payout = Payout(self.scope, step, ticket.gemm_id, flops)
        self._add(payout)
        return flops, payout

    def forget_before(self, step: int) -> None:
        """A checkpoint holds every step before ``step``: those never run again."""
        self._paid = {gemm: p for gemm, p in self._paid.items() if p.step >= step}

    def _add(self, payout: Payout) -> None:
        self._paid[payout.gemm] = Payout(
            payout.scope, payout.step, payout.gemm, self.paid(payout.gemm) + payout.flops
        )
