"""Tickets and hand-made predictions for the scheduler's tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.schedule.scheduler import (
    TileTicket,
)


def ticket(tile_id: str, wire: int = 100) -> TileTicket:
    return TileTicket(tile_id, "g", flops=1000, down_bytes=wire - 10, up_bytes=10)


@dataclass
class Table:
    """A ``Predictor`` from tables: when each (worker, tile) held comes back, and each
    worker's seconds per tile (what a tile adds behind others too, unless ``busy``)."""

    finish: dict[tuple[str, str], float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    busy: dict[str, float] | None = None
    holds: Callable[[str, TileTicket], bool] | None = None
    keeps: bool | None = None  # whether workers keep blocks; None: if ``holds`` is given

    def prefers(self, worker_id: str, ticket: TileTicket) -> bool:
        return self.holds is not None and self.holds(worker_id, ticket)

    def keeps_blocks(self, worker_id: str) -> bool:
        return self.holds is not None if self.keeps is None else self.keeps

    def finish_at(self, worker_id: str, tile_id: str) -> float:
        return self.finish[(worker_id, tile_id)]

    def run_time(self, worker_id: str, ticket: TileTicket) -> float:
        return self.seconds[worker_id]

    def busy_time(self, worker_id: str, ticket: TileTicket) -> float:
        return (self.busy if self.busy is not None else self.seconds)[worker_id]
