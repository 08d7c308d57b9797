"""The ledger of every worker's verified contribution and standing.

Rows are keyed by the worker's Ed25519 public key (hex), which the worker proves it holds
at every connection (``common.auth``): credit, reputation and bans follow the key, never
the name a worker claims (names are for people and may repeat). Every verified tile is
committed within moments of landing, to a store (``coordinator.pool.ledger_stores``):
a SQLite file in the state directory by default, PostgreSQL where ranks share a job, or
memory for the simulator.

Every row is also kept in memory, read once when the ledger opens and updated with every
write: the coordinator reads a worker's standing on every heartbeat and check, and
``/api/status`` lists them all; none of that may query the store on its event loop.

Credit for a training step's tiles is journaled with it, so that a step run again after a
restart pays each of its GEMMs once (``coordinator.pool.payouts``).
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import replace
from pathlib import Path

from coordinator.pool.ledger_stores import (
    Contribution,
    LedgerStore,
    RowChange,
    open_store,
)
from coordinator.pool.payouts import Payout, Payouts
from coordinator.schedule.records import TileTicket

__all__ = ["Contribution", "Ledger"]


class Ledger:
    """Each worker's credit, in a store, with every row also kept in memory.

    ``credit`` and ``reject`` change the row in memory at once and queue their write;
    ``flush`` commits what is queued in one transaction. The server has a thread of
    its own flush after each turn of its event loop that made writes, so the tiles
    verified in one turn cost one commit rather than one each, the loop never waits
    for the store, and a crash loses at most the credit of the last turn or two (tiles
    of the step in flight, which is recomputed).

    Two locks: one for the rows and the queue, held only for moments, so a credit
    never waits for a commit; one for the store, held by each flush from taking the
    queue to its commit, so batches land in the order they were made.
    """

    def __init__(self, where: str | Path | LedgerStore, *, scope: str = "") -> None:
        """``scope``: whose training steps this ledger journals (ranks sharing a store
        each have their own)."""
        self.store = open_store(where) if isinstance(where, (str, Path)) else where
        self._store_lock = threading.Lock()
        self._lock = threading.Lock()
        self._rows = {row.worker: row for row in self.store.rows()}  # as in the memory
        self._payouts = Payouts(scope, self.store.payouts(scope))
        self._journal: dict[str, Payout] = {}  # per GEMM, what it paid since the last commit
        # Writes not yet committed, one change per worker: the credits of a turn of the
        # loop are one row update each worker, not one per tile.
        self._queued: dict[str, RowChange] = {}
        self._writes = 0  # the credits and rejections gathered in ``_queued``
        self._committing = 0  # writes taken from the queue by the commit under way

    def credit(
        self,
        worker: str,
        *,
        name: str,
        flops: int,
        bytes_down: int,
        bytes_up: int,
        compute_s: float,
        reputation: float,
        now: float,
        ticket: TileTicket | None = None,
    ) -> int:
        """One verified tile: credit it, with the worker's reputation after it. Returns
        the FLOPs credited: with its ``ticket``, no more than its GEMM has not paid yet
        (its step may be running again). A tile credited nothing is not counted either,
        but its worker's reputation rises all the same: its result was right."""
        with self._lock:
            paid, payout = self._payouts.pay(ticket) if ticket is not None else (flops, None)
            if payout is not None:
                _journal(self._journal, payout)
        repaid = ticket is not None and paid == 0
        delta = RowChange(
            first_seen=now,
            tiles=0 if repaid else 1,
            flops=paid,
            bytes_down=0 if repaid else bytes_down,
            bytes_up=0 if repaid else bytes_up,
            compute_s=0.0 if repaid else compute_s,
            reputation=reputation,
        )
        self._apply(worker, name, now, delta)
        return paid

    def checkpointed(self, step: int) -> None:
        """A checkpoint of ``step`` completed steps is on disk (or was resumed from):
        the steps before it never run again, so their payouts go."""
        with self._store_lock:
            with self._lock:
                self._payouts.forget_before(step)
                self._journal = {g: p for g, p in self._journal.items() if p.step >= step}
            self.store.forget_payouts(self._payouts.scope, step)

    def start_over(self) -> None:
        """Training starts again from its first step (``--fresh``): no step before it
        has been paid for."""
        self.checkpointed(1 << 62)

    def reject(
        self, worker: str, *, name: str, reputation: float, banned_reason: str = "", now: float
    ) -> None:
        """One result that failed its check: no credit, a lower reputation, maybe a ban."""
        delta = RowChange(
            first_seen=now,
            rejected=1,
            reputation=reputation,
            banned_reason=banned_reason,
            banned_at=now if banned_reason else None,
        )
        self._apply(worker, name, now, delta)

    def _apply(self, worker: str, name: str, now: float, delta: RowChange) -> None:
        """Add ``delta`` to the worker's queued change and to its row in memory."""
        with self._lock:
            queued = self._queued.get(worker)
            if queued is None:
                queued = self._queued[worker] = RowChange(first_seen=now)
            delta.name, delta.last_seen = name, now
            queued.merge(delta)
            self._rows[worker] = delta.applied_to(self._rows.get(worker, Contribution(worker)))
            self._writes += 1

    @property
    def waiting(self) -> int:
        """Writes made that no commit has taken yet."""
        with self._lock:
            return self._writes

    @property
    def queued(self) -> int:
        """Writes made but not yet committed (queued, or in the commit under way)."""
        with self._lock:
            return self._writes + self._committing

    def flush(self) -> None:
        """Commit the queued writes, in the order they were made, in one transaction."""
        with self._store_lock:
            self._flush()

    def _flush(self) -> None:
        """(The caller holds the store's lock.)"""
        with self._lock:
            queued, self._queued = self._queued, {}
            journal, self._journal = self._journal, {}
            self._committing, self._writes = self._writes, 0
        if not queued:
            return
        try:
            self.store.commit(queued, list(journal.values()))
        except BaseException:
            self._requeue(queued, journal)  # a failed transaction wrote none of it
            raise
        finally:
            self._committing = 0

    def _requeue(self, failed: dict[str, RowChange], journal: dict[str, Payout]) -> None:
        """Put a failed commit's writes back ahead of those made since, for the next."""
        with self._lock:
            for worker, later in self._queued.items():
                if worker in failed:
                    failed[worker].merge(later)
                else:
                    failed[worker] = later
            self._queued = failed
            for payout in self._journal.values():
                _journal(journal, payout)
            self._journal = journal
            self._writes += self._committing

    def get(self, worker: str) -> Contribution:
        """The worker's row, from memory (an empty one for a key with no row)."""
        with self._lock:
            return self._rows.get(worker) or Contribution(worker)

    def all(self) -> list[Contribution]:
        """Every row, most FLOPs first."""
        with self._lock:
            rows = list(self._rows.values())
        return sorted(rows, key=_most_flops_first)

    def top(self, count: int) -> tuple[list[Contribution], int]:
        """The ``count`` rows of ``all`` first, without sorting the rest, and how many
        rows there are."""
        with self._lock:
            rows = list(self._rows.values())
        return heapq.nsmallest(count, rows, key=_most_flops_first), len(rows)

    def banned(self) -> list[Contribution]:
        """Banned workers, in the order they were banned."""
        with self._lock:
            rows = [c for c in self._rows.values() if c.banned_reason]
        return sorted(rows, key=lambda c: (c.banned_at or 0.0, c.worker))

    def close(self) -> None:
        with self._store_lock:
            self._flush()
            self.store.close()


def _journal(journal: dict[str, Payout], payout: Payout) -> None:
    """Add a GEMM's payout to what the journal holds for it since the last commit."""
    had = journal.get(payout.gemm)
    journal[payout.gemm] = replace(payout, flops=had.flops + payout.flops) if had else payout


def _most_flops_first(row: Contribution) -> tuple[int, str]:
    return -row.flops, row.worker
