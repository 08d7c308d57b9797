"""Speculative copies, for `Scheduler.speculate`: which late tile goes to which idle
worker. The caller's cost model supplies the predictions; the usual first-result-wins rule
cancels the loser. See `Scheduler.speculate` for the rules."""

from __future__ import annotations

from collections.abc import Callable

from coordinator.schedule.records import Assignment, TileTicket
from coordinator.schedule.state import SchedulerState


def speculative_copies(
    state: SchedulerState,
    now: float,
    finish_at: Callable[[str, str], float],
    run_time: Callable[[str, TileTicket], float],
) -> list[Assignment]:
    """What `Scheduler.speculate` hands out; it documents the arguments."""
    ratio = state.config.speculate_after
    if ratio is None:
        return []
    idle = [worker for _, worker in state.live_turns() if not worker.in_flight]
    if not idle:
        return []
    copies: list[Assignment] = []
    for finish, tile_id in _late_first(state, finish_at):
        if not idle:
            break
        tile = state.tiles[tile_id]
        takers = [
            (run_time(w.worker_id, tile.ticket), i)
            for i, w in enumerate(idle)
            if w.worker_id not in tile.refused_by and w.can_hold(tile.ticket)
        ]
        if not takers:
            continue
        best_time, best = min(takers)
        if finish - now <= ratio * best_time:
            continue
        worker = idle.pop(best)
        copies.append(state.hand_out(tile, worker, now))
        state.refresh_ready(worker)
        state.bump("speculated")
    return copies


def _late_first(
    state: SchedulerState, finish_at: Callable[[str, str], float]
) -> list[tuple[float, str]]:
    """(predicted finish, tile id) of the tiles that may get another holder and are not
    queued, latest first (ties by tile id)."""
    late: list[tuple[float, str]] = []
    for tile_id, tile in state.tiles.items():
        if tile.queue_token is None and 0 < len(tile.holders) < state.config.max_holders:
            finish = min(finish_at(holder, tile_id) for holder in tile.holders)
            late.append((finish, tile_id))
    late.sort(key=lambda entry: (-entry[0], entry[1]))
    return late
