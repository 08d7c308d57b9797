"""What the core predicts for the scheduler: when a worker would return a tile, from what
its tiles taught (``Worker.estimate``), and whether it holds one of a tile's operand
blocks. The scheduler asks these of the core when it steals planned tiles, holds tiles
for a faster worker, copies late ones and prefers workers with a block."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from coordinator.plan.estimates import overdue_finish, queued_start
from coordinator.pool.workers import Worker
from coordinator.schedule.scheduler import Scheduler, TileTicket


class Predictions:
    """The core's ``Predictor``: from its own maps, read as they are at each call."""

    def __init__(
        self,
        workers: Mapping[str, Worker],
        tiles: Mapping[str, Any],
        scheduler: Scheduler,
        now: Callable[[], float],
    ) -> None:
        self._workers = workers
        self._tiles = tiles
        self._scheduler = scheduler
        self._now = now

    def prefers(self, worker_id: str, ticket: TileTicket) -> bool:
        """Whether the worker's operand cache already holds one of the tile's operands:
        then it should get the tile, and the coordinator sends one operand, not two."""
        worker = self._workers.get(worker_id)
        return worker is not None and worker.blocks.holds_any(ticket.blocks)

    def keeps_blocks(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        return worker is not None and worker.blocks.keeps

    def run_time(self, worker_id: str, ticket: TileTicket) -> float:
        """Seconds from sending ``ticket`` to an idle ``worker_id`` until its result."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.estimate is None:
            return float("inf")
        return worker.estimate.tile_seconds(ticket.flops, ticket.down_bytes, ticket.up_bytes)

    def busy_time(self, worker_id: str, ticket: TileTicket) -> float:
        """Seconds ``ticket`` adds behind a worker's other tiles (its prefetch window
        overlaps transfers with compute)."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.estimate is None:
            return float("inf")
        if worker.window < 2:
            return self.run_time(worker_id, ticket)
        return worker.estimate.pipelined_seconds(ticket.flops, ticket.down_bytes, ticket.up_bytes)

    def finish_at(self, worker_id: str, tile_id: str) -> float:
        """When ``worker_id`` will return ``tile_id``: after the tiles sent to it before
        this one (it computes one at a time), later once it is overdue."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return float("inf")
        now = self._now()
        # A tile the scheduler handed out in the assign call asking is sent right after.
        sent = worker.sent_at.get(tile_id, now)
        expected = 0.0
        for held in self._scheduler.in_flight(worker_id):
            tile = self._tiles.get(held)
            if tile is not None and worker.sent_at.get(held, now) <= sent:
                expected += self.run_time(worker_id, tile.ticket)
        return overdue_finish(queued_start(sent, worker.last_result_at), expected, now)
