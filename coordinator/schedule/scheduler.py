"""Every tile's life at the coordinator, without I/O: the clock comes in as `now`.

    queued ──assign──► assigned(worker, deadline) ──complete──► done
      ▲                    │
      └──── lost ◄─────────┘  disconnect, missed heartbeats, pause, refusal or failed
                              verification, deadline passed

The server and the discrete-event simulator drive the same object: they call these
methods when something happens and act on what comes back (send the assignments, send
cancels). Nothing here sleeps, reads a clock or touches a socket.

A tile may have several holders at once: when its deadline passes it is queued again,
and the straggler keeps it until someone finishes; the first valid result wins and the
other holders get a cancel. Lost tiles go back to the *front* of the queue: the GEMM that
waits on them is already late.

Call `expire(now)` before `assign(now)` so that dead workers are not handed tiles.

Planned tiles: a ticket may name the worker the cost-model planner placed it on
(`TileTicket.planned_for`). It waits in that worker's own queue and goes to it first; a
worker left with free slots takes the last planned tile of the worker that would finish
it latest, when it would return that tile clearly sooner (work stealing by earliest
finish, with the caller's `Predictor` and `STEAL_MARGIN`; without predictions, from the
longest planned queue). So the schedule the planner predicted is the one that runs, and a
wrong prediction costs a steal, not a stall.

Speculative copies (opt-in, `SchedulerConfig.speculate_after`): `speculate(now, ...)`
hands a copy of a tile whose holder is predicted to be late to an idle worker that would
finish it much sooner. The caller's `Predictor` supplies the predictions; the scheduler
only decides which tile goes where, and the usual first-result-wins rule cancels the
loser.
"""

from __future__ import annotations

from collections.abc import Iterable

from coordinator.schedule.assignment import PREFERENCE_LOOKAHEAD, STEAL_MARGIN, assign_tiles
from coordinator.schedule.predictor import Predictor
from coordinator.schedule.records import (
    SHARED_SLOT_FLOPS,
    Assignment,
    Completion,
    Expiry,
    SchedulerConfig,
    SchedulerStats,
    TileRecord,
    TileTicket,
    UnknownWorkerError,
    Verdict,
    WorkerRecord,
)
from coordinator.schedule.speculation import speculative_copies
from coordinator.schedule.state import SchedulerState

# The records, config and constants live in their own modules; callers import them from
# here, with the scheduler.
__all__ = [
    "PREFERENCE_LOOKAHEAD",
    "SHARED_SLOT_FLOPS",
    "STEAL_MARGIN",
    "Assignment",
    "Completion",
    "Expiry",
    "Predictor",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "TileTicket",
    "UnknownWorkerError",
    "Verdict",
]

_DEFAULT_CONFIG = SchedulerConfig()


class Scheduler:
    """Queue, assignment, deadlines and re-issue for tiles; see the module docstring."""

    def __init__(self, config: SchedulerConfig = _DEFAULT_CONFIG) -> None:
        self._state = SchedulerState(config)

    # --- workers ------------------------------------------------------------------------

    def add_worker(
        self, worker_id: str, *, window: int, now: float, mem_cap_bytes: int | None = None
    ) -> None:
        """Register a worker that may hold up to `window` tiles at once (its prefetch)."""
        state = self._state
        if worker_id in state.workers:
            raise ValueError(f"worker {worker_id!r} is already registered")
        if window < 1:
            raise ValueError(f"worker {worker_id!r}: window must be >= 1, got {window}")
        if mem_cap_bytes is not None and mem_cap_bytes < 1:
            raise ValueError(f"worker {worker_id!r}: mem_cap_bytes must be >= 1")
        worker = WorkerRecord(
            worker_id, window, mem_cap_bytes, now, state.next_seq(), state.config.slot_flops
        )
        state.joined(worker)
        state.window_total += window
        state.push_heartbeat(worker)
        state.refresh_ready(worker)

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        """Forget a worker; returns the tiles that went back to the queue because of it.

        A tile another worker still holds within its deadline stays with that worker.
        Removing an unknown worker is a no-op, so disconnect and expiry may race.
        """
        worker = self._state.workers.get(worker_id)
        if worker is None:
            return []
        return self._state.drop_worker(worker, now)

    def heartbeat(self, worker_id: str, now: float) -> None:
        self._state.touch(self._state.known(worker_id), now)

    def set_paused(self, worker_id: str, paused: bool, now: float) -> list[str]:
        """Pause or resume a worker; pausing takes back its tiles and returns those queued again."""
        state = self._state
        worker = state.known(worker_id)
        state.touch(worker, now)
        if worker.paused == paused:
            return []
        worker.paused = paused
        (state.active_caps.remove if paused else state.active_caps.add)(worker.mem_cap_bytes)
        lost: list[str] = []
        if paused:
            for tile_id in worker.in_flight:
                tile = state.tiles[tile_id]
                del tile.holders[worker_id]
                tile.released_to.add(worker_id)
                worker.released.add(tile_id)
                if state.needs_requeue(tile, now):
                    lost.append(tile_id)
            worker.let_go_all()
            state.release_planned(worker_id)
            state.requeue_front(lost)
        state.refresh_ready(worker)
        return lost

    # --- tiles --------------------------------------------------------------------------

    def submit(self, tickets: Iterable[TileTicket]) -> None:
        """Queue tiles at the back, in order. A tile id already known raises ValueError."""
        state = self._state
        batch = list(tickets)
        seen: set[str] = set()
        for ticket in batch:
            tile_id = ticket.tile_id
            if tile_id in state.tiles or tile_id in state.done or tile_id in seen:
                raise ValueError(f"tile {tile_id!r} was already submitted")
            seen.add(tile_id)
        for ticket in batch:
            tile = TileRecord(ticket)
            state.tiles[ticket.tile_id] = tile
            state.tiles_by_gemm.setdefault(ticket.gemm_id, {})[ticket.tile_id] = None
            state.enqueue(tile, front=False)
        state.bump("submitted", len(batch))

    def assign(
        self, now: float, predictor: Predictor | None = None, *, timed: bool = True
    ) -> list[Assignment]:
        """Fill free window slots: first each worker's planned tiles, then the common
        queue FIFO, one slot per worker in turn, then steals of planned tiles.

        A tile goes to the next worker in the rotation that may take it: not paused, not
        already holding it, never refused it, and with a memory cap that fits it. A tile
        nobody may take stays queued in place; the tiles behind it still go out.

        With a ``predictor``, a worker among the next few in turn that it ``prefers`` for
        a tile takes the tile ahead of its turn, and a lone free worker that
        ``keeps_blocks`` takes the first of the next few tiles of the head's GEMM it is
        preferred for (the head stays at the front). Its timings (unless ``timed`` is false:
        they cost a prediction per worker per call) decide steals: a worker with a free
        slot takes another's planned tile only when it would return it before that
        worker, counting each from when it is free of what it holds (``finish_at``) and,
        for the planned worker, of its planned tiles ahead (``busy_time`` each). With
        `SchedulerConfig.leave_for_faster` they also make a worker pass on a fresh tile of
        the common queue that another worker would return that many times sooner
        (``run_time``); the tile waits for that worker. Without them, free workers steal
        from the longest planned queue.
        """
        if predictor is None:
            return assign_tiles(self._state, now)
        prefers, keeps = predictor.prefers, predictor.keeps_blocks
        if not timed:
            return assign_tiles(self._state, now, prefers=prefers, keeps=keeps)
        return assign_tiles(
            self._state,
            now,
            prefers=prefers,
            keeps=keeps,
            finish_at=predictor.finish_at,
            run_time=predictor.run_time,
            busy_time=predictor.busy_time,
        )

    def complete(self, worker_id: str, tile_id: str, now: float) -> Completion:
        """A result passed verification. The first one for a tile wins.

        A holder whose deadline passed, or that paused after taking the tile, still wins
        if the tile is not done yet. A worker that was removed never wins.
        """
        state = self._state
        worker = state.workers.get(worker_id)
        tile = state.tiles.get(tile_id)
        if worker is not None:
            state.touch(worker, now)
            if tile is not None and (worker_id in tile.holders or worker_id in tile.released_to):
                cancel = state.retire(tile, winner=worker_id)
                state.mark_done(tile.ticket)
                state.bump("completed")
                return Completion(Verdict.ACCEPTED, tuple(cancel))
        if tile_id in state.done or (worker is not None and tile_id in worker.cancelled):
            state.bump("duplicates")
            return Completion(Verdict.DUPLICATE)
        return Completion(Verdict.NOT_ASSIGNED)

    def speculate(self, now: float, predictor: Predictor) -> list[Assignment]:
        """Copy late tiles to idle workers; returns the copies to send. Off (always [])
        unless `SchedulerConfig.speculate_after` is set.

        The predictor's ``finish_at`` says when a holder returns its tile, its
        ``run_time`` how long an idle worker needs from assignment to result. Only
        workers holding nothing count as idle, so a copy never waits behind other work.
        Latest tiles are rescued first, each by the idle worker that would return it
        soonest; a tile gets a copy when every holder's predicted finish is more than
        `speculate_after` times that worker's run time away. Queued tiles are left to
        assign(), which serves them anyway.
        """
        return speculative_copies(self._state, now, predictor.finish_at, predictor.run_time)

    def stranded(self) -> list[str]:
        """Queued tiles that no connected, unpaused worker may ever take: every one of
        them refused the tile, or it exceeds every one's memory cap. Waiting would wait
        forever, so the caller computes these itself. Empty while no worker is active
        (then waiting for one is right). O(1) unless a queued tile is larger than every
        active worker's memory cap or was refused; then O(queue)."""
        state = self._state
        if not state.active_caps.workers:
            return []
        largest_cap = state.active_caps.largest()
        biggest = state.queued_sizes.largest()
        too_big = largest_cap is not None and biggest is not None and biggest > largest_cap
        refused = (state.tiles[tile_id] for tile_id in state.refused)
        if not too_big and not any(t.queue_token is not None and not t.holders for t in refused):
            return []  # what a leave or a refusal usually finds, without reading the queue
        active = [w for w in state.workers.values() if not w.paused]
        stranded = []
        for entry in state.queue:
            tile = state.live_queue_entry(entry)
            if tile is None or tile.holders:
                continue
            too_big = largest_cap is not None and tile.ticket.wire_bytes > largest_cap
            if too_big or (
                len(tile.refused_by) >= 1
                and not any(
                    w.worker_id not in tile.refused_by and w.can_hold(tile.ticket) for w in active
                )
            ):
                stranded.append(tile.tile_id)
        return stranded

    def take_over(self, tile_id: str) -> list[str]:
        """The caller computed a tile itself: it is done. Returns holders to cancel."""
        state = self._state
        tile = state.tiles.get(tile_id)
        if tile is None:
            return []
        cancel = state.retire(tile, winner=None)
        state.mark_done(tile.ticket)
        state.bump("completed")
        return cancel

    def reject(self, worker_id: str, tile_id: str, now: float, *, reason: str) -> bool:
        """The worker refused the tile, or its result failed verification.

        The worker never gets this tile again. The tile goes to the front of the queue
        unless another worker holds it within its deadline; returns True if it is now
        at the front of the queue. `reason` is for the caller's logs only.
        """
        state = self._state
        worker = state.workers.get(worker_id)
        tile = state.tiles.get(tile_id)
        if worker is None or tile is None:
            return False
        state.touch(worker, now)
        held = worker_id in tile.holders
        if not held and worker_id not in tile.released_to:
            return False
        tile.refused_by.add(worker_id)
        state.refused[tile_id] = None
        state.bump("rejected")
        if held:
            del tile.holders[worker_id]
            worker.let_go(tile_id)
            state.refresh_ready(worker)
        tile.released_to.discard(worker_id)
        worker.released.discard(tile_id)
        if tile.has_live_holder(now):
            return False
        state.requeue_front([tile_id])
        return True

    def expire(self, now: float) -> Expiry:
        """Remove workers whose last heartbeat is older than the timeout, then queue again
        the tiles whose deadline passed (their holders keep them and may still win)."""
        dead, requeued = self._state.drop_silent_workers(now)
        overdue = self._state.requeue_overdue(now)
        return Expiry(tuple(dead), tuple(requeued) + tuple(overdue))

    def forget_gemm(self, gemm_id: str) -> list[tuple[str, str]]:
        """Drop every tile of a GEMM, queued, in flight or done.

        Returns (worker_id, tile_id) pairs whose holders the caller should cancel.
        """
        state = self._state
        pairs: list[tuple[str, str]] = []
        for tile_id in state.tiles_by_gemm.pop(gemm_id, {}):
            tile = state.tiles[tile_id]
            pairs.extend((worker_id, tile_id) for worker_id in state.retire(tile, winner=None))
        for tile_id in state.done_by_gemm.pop(gemm_id, set()):
            del state.done[tile_id]
        return pairs

    # --- read-only views ----------------------------------------------------------------

    def in_flight(self, worker_id: str) -> frozenset[str]:
        worker = self._state.workers.get(worker_id)
        return frozenset(worker.in_flight) if worker is not None else frozenset()

    def queued_count(self) -> int:
        return self._state.queued

    def pending(self) -> int:
        """Tiles submitted and neither done nor forgotten."""
        return len(self._state.tiles)

    def is_done(self, tile_id: str) -> bool:
        return tile_id in self._state.done

    def workers(self) -> list[str]:
        return list(self._state.workers)

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(**self._state.counts)

    def check_invariants(self) -> None:
        """Raise RuntimeError if internal indexes disagree (for tests and the simulator)."""
        for problem in self._state.invariant_problems():
            raise RuntimeError(f"scheduler invariant broken: {problem}")
