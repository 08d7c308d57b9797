"""Tickets and tables of run times for the scheduler's tests."""

from __future__ import annotations

from coordinator.schedule.scheduler import (
    TileTicket,
)


def ticket(tile_id: str, wire: int = 100) -> TileTicket:
    return TileTicket(tile_id, "g", flops=1000, down_bytes=wire - 10, up_bytes=10)


def table(finish: dict[tuple[str, str], float]):  # type: ignore[no-untyped-def]
    return lambda worker_id, tile_id: finish[(worker_id, tile_id)]


def run_times(seconds: dict[str, float]):  # type: ignore[no-untyped-def]
    return lambda worker_id, _ticket: seconds[worker_id]
