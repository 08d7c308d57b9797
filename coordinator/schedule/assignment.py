"""Filling free window slots, for `Scheduler.assign`: each worker's planned tiles, then
the common queue in turn (with operand preferences and earliest-finish holds), then steals
of planned tiles by earliest finish. See `Scheduler.assign` for the rules."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable

from coordinator.schedule.records import Assignment, TileRecord, TileTicket, WorkerRecord
from coordinator.schedule.state import QueueEntry, SchedulerState

PREFERENCE_LOOKAHEAD = 16  # workers in turn checked for a preference: O(1) per tile
# A steal must promise to return the tile this many times sooner than its planned worker:
# it costs bytes the prediction does not see (the planned worker may hold an operand
# block already; the download shares the coordinator's uplink), so on fast links a steal
# on any predicted gain makes a GEMM slower than no steal at all (the simulator shows it).
STEAL_MARGIN = 1.5

Prefers = Callable[[str, TileTicket], bool]
Keeps = Callable[[str], bool]
FinishAt = Callable[[str, str], float]
RunTime = Callable[[str, TileTicket], float]


def assign_tiles(
    state: SchedulerState,
    now: float,
    *,
    prefers: Prefers | None = None,
    keeps: Keeps | None = None,
    finish_at: FinishAt | None = None,
    run_time: RunTime | None = None,
    busy_time: RunTime | None = None,
) -> list[Assignment]:
    """What `Scheduler.assign` hands out; it documents the arguments. Costs what it
    hands out (and the predictions), not the number of workers free to take it: the
    turn order is `state.ring`, kept from call to call."""
    if state.queued == 0 or not state.ready:
        return []
    assignments: list[Assignment] = []
    if state.planned:
        for owner in list(state.planned):
            worker = state.workers.get(owner)
            if worker is not None and worker.turn:
                assignments.extend(_take_planned(state, worker, now))
    if state.queue and state.ready:
        assignments.extend(_assign_common(state, now, prefers, keeps, finish_at, run_time))
    if state.planned and state.ready:
        costs = _StealCosts(state, now, finish_at, run_time, busy_time)
        assignments.extend(_steal(state, now, costs))
    return assignments


def _take_planned(state: SchedulerState, worker: WorkerRecord, now: float) -> list[Assignment]:
    """The worker's own planned tiles, in plan order, into its free slots."""
    queue = state.planned.get(worker.worker_id)
    assignments = []
    while queue and worker.has_room():
        tile = state.live_queue_entry(queue.popleft())
        if tile is not None:
            assignments.append(state.dequeue_to(tile, worker, now))
    if queue is not None and not queue:
        del state.planned[worker.worker_id]
    if not worker.has_room():
        state.unready(worker)
    return assignments


def _assign_common(
    state: SchedulerState,
    now: float,
    prefers: Prefers | None,
    keeps: Keeps | None,
    finish_at: FinishAt | None,
    run_time: RunTime | None,
) -> list[Assignment]:
    """The common queue, FIFO, to the workers in turn (`_next_taker`). A lone free
    worker that `keeps` blocks takes a tile of the head's GEMM it `prefers` from among
    the next few instead of the head: the caller's mirror of its blocks knows what it
    holds, and with one worker to serve there is no other to prefer."""
    slower = _slower_filter(state, now, finish_at, run_time)
    largest_cap = state.largest_cap()
    assignments: list[Assignment] = []
    passed_over: list[QueueEntry] = []
    turns: dict[str, int] = {}  # tiles taken so far in the turn of the worker at the front
    while state.ready and state.queue:
        entry = state.queue.popleft()
        tile = state.live_queue_entry(entry)
        if tile is None:
            continue
        if prefers and keeps and len(state.ready) == 1:
            lone = state.workers[next(iter(state.ready))]
            if keeps(lone.worker_id):
                entry, tile = _preferred_ahead(state, lone, entry, tile, prefers)
        worker = None
        if largest_cap is None or tile.ticket.wire_bytes <= largest_cap:
            worker = _next_taker(state, tile, prefers, slower, turns)
        if worker is None:
            passed_over.append(entry)
            continue
        assignments.append(state.dequeue_to(tile, worker, now))
    state.queue.extendleft(reversed(passed_over))
    return assignments


def _preferred_ahead(
    state: SchedulerState,
    worker: WorkerRecord,
    entry: QueueEntry,
    tile: TileRecord,
    prefers: Prefers,
) -> tuple[QueueEntry, TileRecord]:
    """`tile` (just taken off the queue), or the first of the next few queued tiles of
    its GEMM that `worker` prefers and may take; then `tile` goes back to the front.
    Only within one GEMM: a later GEMM's tile must not pass an earlier one's, which the
    step may be waiting on; within one, the GEMM is done only when all its tiles are."""
    if prefers(worker.worker_id, tile.ticket):
        return entry, tile
    gemm_id = tile.ticket.gemm_id
    for i, ahead in enumerate(itertools.islice(state.queue, PREFERENCE_LOOKAHEAD)):
        other = state.live_queue_entry(ahead)
        if other is None:
            continue
        if other.ticket.gemm_id != gemm_id:
            break
        if prefers(worker.worker_id, other.ticket) and _may_take(worker, other):
            del state.queue[i]
            state.queue.appendleft(entry)
            return ahead, other
    return entry, tile


def _slower_filter(
    state: SchedulerState,
    now: float,
    finish_at: FinishAt | None,
    run_time: RunTime | None,
) -> Callable[[WorkerRecord, TileRecord], bool] | None:
    """`slower(worker, tile)` for one assign call: True when another worker would
    return the fresh tile `leave_for_faster` times sooner. Each worker's free time is
    predicted once per call, the soonest return once per tile size."""
    ratio = state.config.leave_for_faster
    if ratio is None or finish_at is None or run_time is None:
        return None
    active = [w for w in state.workers.values() if not w.paused]
    free = {
        w.worker_id: max([now, *(finish_at(w.worker_id, t) for t in w.in_flight)]) for w in active
    }
    soonest: dict[tuple[int, int, int], float] = {}

    def eta(worker: WorkerRecord, ticket: TileTicket) -> float:
        return free[worker.worker_id] - now + run_time(worker.worker_id, ticket)

    def slower(worker: WorkerRecord, tile: TileRecord) -> bool:
        ticket = tile.ticket
        if tile.times_assigned or tile.refused_by or worker.worker_id not in free:
            return False
        size = (ticket.flops, ticket.down_bytes, ticket.up_bytes)
        if size not in soonest:
            soonest[size] = min(
                (eta(w, ticket) for w in active if w.can_hold(ticket)), default=math.inf
            )
        return eta(worker, ticket) > ratio * soonest[size]

    return slower


class _StealCosts:
    """The caller's predictions as one steal pass uses them, in seconds from `now`; each
    worker's free time is asked for once. Without predictions every tile counts 1, so
    backlogs are queue lengths."""

    def __init__(
        self,
        state: SchedulerState,
        now: float,
        finish_at: FinishAt | None,
        run_time: RunTime | None,
        busy_time: RunTime | None,
    ) -> None:
        self._state = state
        self._now = now
        self._finish_at = finish_at
        self._run_time = run_time
        self._busy_time = busy_time
        self.predict = finish_at is not None and run_time is not None
        self.free: dict[str, float] = {}  # seconds until a worker is free of its tiles

    def free_in(self, worker_id: str) -> float:
        if worker_id not in self.free:
            held = self._state.workers[worker_id].in_flight
            finish_at = self._finish_at
            assert finish_at is not None
            self.free[worker_id] = max([0.0, *(finish_at(worker_id, t) - self._now for t in held)])
        return self.free[worker_id]

    def seconds(self, worker_id: str, ticket: TileTicket) -> float:
        return self._run_time(worker_id, ticket) if self._run_time is not None else 1.0

    def added(self, worker_id: str, ticket: TileTicket) -> float:
        """What a tile adds behind others: transfers overlap compute then."""
        if not self.predict:
            return 1.0
        return (self._busy_time or self.seconds)(worker_id, ticket)

    def planned_ends(self) -> list[tuple[float, str]]:
        """When each planned worker would return its last planned tile, as a heap of
        (-seconds, owner), latest first. Drops stale entries from the planned queues, so
        a steal pass meets none."""
        state = self._state
        heap: list[tuple[float, str]] = []
        for owner in list(state.planned):
            live = [e for e in state.planned[owner] if state.live_queue_entry(e) is not None]
            if not live:
                del state.planned[owner]
                continue
            state.planned[owner] = deque(live)
            tickets = [state.tiles[tile_id].ticket for tile_id, _ in live]
            end = sum(self.added(owner, t) for t in tickets)
            if self.predict:
                end = max(self.free_in(owner) + end, self.seconds(owner, tickets[-1]))
            heap.append((-end, owner))
        heapq.heapify(heap)
        return heap

    def return_in(self, worker_id: str, ticket: TileTicket) -> float:
        """When the worker would return the tile if it took it now, behind what it holds."""
        return max(
            self.free_in(worker_id) + self.added(worker_id, ticket),
            self.seconds(worker_id, ticket),
        )


def _steal(state: SchedulerState, now: float, costs: _StealCosts) -> list[Assignment]:
    """The ready workers, in turn, take planned tiles of others, from the back of the
    queue whose last tile would be back latest, while they would return it sooner than
    its planned worker. Without predictions: from the longest queue. O(owners + steals
    x log owners), plus the predictions."""
    heap = costs.planned_ends()
    assignments: list[Assignment] = []
    takers = (worker for _, worker in state.live_turns())
    worker = next(takers, None)
    while worker is not None and heap:
        neg_end, owner = heap[0]
        queue = state.planned[owner]
        if not queue:
            del state.planned[owner]
            heapq.heappop(heap)
            continue
        tile = state.tiles[queue[-1][0]]
        took = False
        if owner != worker.worker_id and _may_take(worker, tile):
            theirs = -neg_end
            mine = costs.return_in(worker.worker_id, tile.ticket) if costs.predict else 0.0
            if not costs.predict or mine * STEAL_MARGIN < theirs:
                queue.pop()
                assignments.append(state.dequeue_to(tile, worker, now))
                costs.free[worker.worker_id] = mine
                heapq.heapreplace(heap, (costs.added(owner, tile.ticket) - theirs, owner))
                took = True
        if not worker.has_room():
            state.unready(worker)  # (the generator skips its entry: no longer live)
        if not took or not worker.turn:
            worker = next(takers, None)
    return assignments


def _may_take(worker: WorkerRecord, tile: TileRecord) -> bool:
    return (
        worker.worker_id not in tile.refused_by
        and worker.worker_id not in tile.holders
        and worker.can_hold(tile.ticket)
    )


def _next_taker(
    state: SchedulerState,
    tile: TileRecord,
    prefers: Prefers | None = None,
    slower: Callable[[WorkerRecord, TileRecord], bool] | None = None,
    turns: dict[str, int] | None = None,
) -> WorkerRecord | None:
    """The next worker in turn that may take the tile (or a preferred one among the next
    few), unless `slower` says another would return it much sooner; rotates the ring
    past it. A worker that fills its window is no longer ready."""

    def may(worker: WorkerRecord) -> bool:
        return _may_take(worker, tile) and (slower is None or not slower(worker, tile))

    ring = state.ring
    turns = turns if turns is not None else {}
    if prefers is not None:
        state.drop_stale_turns()
        for i, entry in enumerate(itertools.islice(ring, PREFERENCE_LOOKAHEAD)):
            turn, worker = entry
            if turn == worker.turn and prefers(worker.worker_id, tile.ticket) and may(worker):
                del ring[i]
                if worker.room_after(tile.ticket):
                    ring.append(entry)
                else:
                    state.unready(worker)
                return worker
    for _ in range(len(ring)):
        entry = ring.popleft()
        turn, worker = entry
        if turn != worker.turn:
            continue  # stale: it is not ready any more
        if not may(worker):
            ring.append(entry)
            continue
        if not worker.room_after(tile.ticket):
            state.unready(worker)
            return worker
        # A turn is a refill's worth of tiles (one, unless small tiles share slots:
        # then they go out together).
        taken = turns.get(worker.worker_id, 0) + 1
        if taken < worker.refill_tiles:
            turns[worker.worker_id] = taken
            ring.appendleft(entry)
        else:
            turns.pop(worker.worker_id, None)
            ring.append(entry)
        return worker
    return None
