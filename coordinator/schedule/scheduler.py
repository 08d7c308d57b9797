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
finish, with the caller's predictions and `STEAL_MARGIN`; without predictions, from the
longest planned queue). So the schedule
the planner predicted is the one that runs, and a wrong prediction costs a steal, not a
stall.

Speculative copies (opt-in, `SchedulerConfig.speculate_after`): `speculate(now, ...)`
hands a copy of a tile whose holder is predicted to be late to an idle worker that would
finish it much sooner. The caller's cost model supplies the predictions; the scheduler
only decides which tile goes where, and the usual first-result-wins rule cancels the
loser.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


class UnknownWorkerError(KeyError):
    """An operation named a worker that is not (or no longer) registered."""


@dataclass(frozen=True)
class TileTicket:
    tile_id: str
    gemm_id: str
    flops: int
    down_bytes: int
    up_bytes: int
    blocks: tuple[str, ...] = ()  # its operand block ids (see assign's ``prefers``)
    # The worker the planner placed it on: the tile waits for that worker unless another
    # would return it sooner (see the module docstring). None: whoever is free.
    planned_for: str | None = None

    def __post_init__(self) -> None:
        if min(self.flops, self.down_bytes, self.up_bytes) < 0:
            raise ValueError(f"tile {self.tile_id!r}: sizes must be >= 0")

    @property
    def wire_bytes(self) -> int:
        """Operands plus result: what must fit in a worker's memory cap."""
        return self.down_bytes + self.up_bytes


@dataclass(frozen=True)
class Assignment:
    worker_id: str
    tile_id: str
    deadline: float
    reissue: bool  # the tile had been assigned before (counts toward stats.reissued)


class Verdict(enum.Enum):
    ACCEPTED = "accepted"  # first valid result for this tile: use it
    DUPLICATE = "duplicate"  # tile already done (speculative or late copy): ignore, no error
    NOT_ASSIGNED = "not_assigned"  # worker never held this tile, or tile unknown: violation


@dataclass(frozen=True)
class Completion:
    verdict: Verdict
    cancel: tuple[str, ...] = ()  # other workers still holding the tile: send them a cancel


@dataclass(frozen=True)
class Expiry:
    dead_workers: tuple[str, ...] = ()  # heartbeat older than the timeout: removed
    requeued: tuple[str, ...] = ()  # tiles queued again, from dead workers and deadlines


@dataclass(frozen=True)
class SchedulerStats:
    submitted: int = 0
    completed: int = 0
    reissued: int = 0
    rejected: int = 0
    duplicates: int = 0
    speculated: int = 0  # copies handed out by speculate() (also counted in reissued)


@dataclass(frozen=True)
class SchedulerConfig:
    heartbeat_timeout_s: float = 10.0
    tile_timeout_s: float = 120.0  # then the tile is queued again; the holder may still win
    # Speculative copies, off by default. A tile is late when its holders' predicted
    # finish lies more than `speculate_after` times an idle worker's run time in the
    # future: then a copy is worth its bytes. Ratios near 1 burn bandwidth on ties.
    speculate_after: float | None = None
    max_holders: int = 2  # a tile is never held by more workers than this at once
    # Earliest finish: a worker with a free slot leaves a tile in the queue when another
    # worker (busy now, perhaps) is predicted to return it more than this many times
    # sooner; None: off. Needs assign()'s predictions. Fresh tiles only: a re-issued or
    # refused one goes to whoever is free.
    leave_for_faster: float | None = None

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= 0 or self.tile_timeout_s <= 0:
            raise ValueError("SchedulerConfig timeouts must be > 0")
        if self.speculate_after is not None and self.speculate_after < 1.0:
            raise ValueError("SchedulerConfig.speculate_after must be >= 1 or None")
        if self.max_holders < 1:
            raise ValueError("SchedulerConfig.max_holders must be >= 1")
        if self.leave_for_faster is not None and self.leave_for_faster < 1.0:
            raise ValueError("SchedulerConfig.leave_for_faster must be >= 1 or None")


@dataclass(frozen=True)
class _Holding:
    deadline: float
    seq: int  # identifies this assignment among stale deadline-heap entries


@dataclass(eq=False)
class _Worker:
    worker_id: str
    window: int
    mem_cap_bytes: int | None
    last_seen: float
    incarnation: int  # tells a re-added worker's heartbeat entries from its predecessor's
    paused: bool = False
    in_flight: dict[str, None] = field(default_factory=dict)  # ordered set, assignment order
    # Tiles taken back when the worker paused: a result that was already on its way
    # still counts, so they are remembered until the tile is done or the worker leaves.
    released: set[str] = field(default_factory=set)
    # Tiles recently cancelled for this worker: a result that crossed the cancel is a
    # harmless duplicate even after the tile's GEMM has been forgotten.
    cancelled: dict[str, None] = field(default_factory=dict)

    def free_slots(self) -> int:
        return self.window - len(self.in_flight)

    def can_hold(self, ticket: TileTicket) -> bool:
        return self.mem_cap_bytes is None or ticket.wire_bytes <= self.mem_cap_bytes

    def remember_cancel(self, tile_id: str) -> None:
        self.cancelled[tile_id] = None
        if len(self.cancelled) > 4 * self.window + 16:
            del self.cancelled[next(iter(self.cancelled))]


@dataclass(eq=False)
class _Tile:
    ticket: TileTicket
    holders: dict[str, _Holding] = field(default_factory=dict)
    released_to: set[str] = field(default_factory=set)  # mirror of _Worker.released
    refused_by: set[str] = field(default_factory=set)
    times_assigned: int = 0
    queue_token: int | None = None  # set while queued; matches its one live queue entry

    @property
    def tile_id(self) -> str:
        return self.ticket.tile_id

    def has_live_holder(self, now: float) -> bool:
        return any(h.deadline >= now for h in self.holders.values())


class Scheduler:
    """Queue, assignment, deadlines and re-issue for tiles; see the module docstring."""

    def __init__(self, config: SchedulerConfig = SchedulerConfig()) -> None:
        self._config = config
        self._workers: dict[str, _Worker] = {}
        # Unpaused workers with a free slot, in the order they are served next.
        self._ready: dict[str, None] = {}
        self._tiles: dict[str, _Tile] = {}  # submitted and not done
        self._tiles_by_gemm: dict[str, dict[str, None]] = {}
        self._done: dict[str, str] = {}  # tile_id -> gemm_id, until the GEMM is forgotten
        self._done_by_gemm: dict[str, set[str]] = {}
        # Entries are (tile_id, token); an entry whose token no longer matches the tile's
        # is stale and skipped, which makes removal from the middle O(1).
        self._queue: deque[tuple[str, int]] = deque()
        # Fresh tiles planned for a worker, per worker, in plan order (same entries).
        self._planned: dict[str, deque[tuple[str, int]]] = {}
        self._queued = 0
        self._seq = 0
        # Min-heaps with lazy deletion: entries are checked against live state when popped.
        self._deadlines: list[tuple[float, int, str, str]] = []
        self._heartbeats: list[tuple[float, int, str]] = []
        self._window_total = 0
        self._counts = dict.fromkeys(_STAT_NAMES, 0)

    # --- workers ------------------------------------------------------------------------

    def add_worker(
        self, worker_id: str, *, window: int, now: float, mem_cap_bytes: int | None = None
    ) -> None:
        """Register a worker that may hold up to `window` tiles at once (its prefetch)."""
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already registered")
        if window < 1:
            raise ValueError(f"worker {worker_id!r}: window must be >= 1, got {window}")
        if mem_cap_bytes is not None and mem_cap_bytes < 1:
            raise ValueError(f"worker {worker_id!r}: mem_cap_bytes must be >= 1")
        worker = _Worker(worker_id, window, mem_cap_bytes, now, self._next_seq())
        self._workers[worker_id] = worker
        self._window_total += window
        self._push_heartbeat(worker)
        self._refresh_ready(worker)

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        """Forget a worker; returns the tiles that went back to the queue because of it.

        A tile another worker still holds within its deadline stays with that worker.
        Removing an unknown worker is a no-op, so disconnect and expiry may race.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return []
        return self._drop_worker(worker, now)

    def heartbeat(self, worker_id: str, now: float) -> None:
        self._touch(self._known(worker_id), now)

    def set_paused(self, worker_id: str, paused: bool, now: float) -> list[str]:
        """Pause or resume a worker; pausing takes back its tiles and returns those queued again."""
        worker = self._known(worker_id)
        self._touch(worker, now)
        if worker.paused == paused:
            return []
        worker.paused = paused
        lost: list[str] = []
        if paused:
            for tile_id in worker.in_flight:
                tile = self._tiles[tile_id]
                del tile.holders[worker_id]
                tile.released_to.add(worker_id)
                worker.released.add(tile_id)
                if self._needs_requeue(tile, now):
                    lost.append(tile_id)
            worker.in_flight.clear()
            self._release_planned(worker_id)
            self._requeue_front(lost)
        self._refresh_ready(worker)
        return lost

    # --- tiles --------------------------------------------------------------------------

    def submit(self, tickets: Iterable[TileTicket]) -> None:
        """Queue tiles at the back, in order. A tile id already known raises ValueError."""
        batch = list(tickets)
        seen: set[str] = set()
        for ticket in batch:
            tile_id = ticket.tile_id
            if tile_id in self._tiles or tile_id in self._done or tile_id in seen:
                raise ValueError(f"tile {tile_id!r} was already submitted")
            seen.add(tile_id)
        for ticket in batch:
            tile = _Tile(ticket)
            self._tiles[ticket.tile_id] = tile
            self._tiles_by_gemm.setdefault(ticket.gemm_id, {})[ticket.tile_id] = None
            self._enqueue(tile, front=False)
        self._bump("submitted", len(batch))

    def assign(
        self,
        now: float,
        prefers: Callable[[str, TileTicket], bool] | None = None,
        finish_at: Callable[[str, str], float] | None = None,
        run_time: Callable[[str, TileTicket], float] | None = None,
        busy_time: Callable[[str, TileTicket], float] | None = None,
    ) -> list[Assignment]:
        """Fill free window slots: first each worker's planned tiles, then the common
        queue FIFO, one slot per worker in turn, then steals of planned tiles.

        A tile goes to the next worker in the rotation that may take it: not paused, not
        already holding it, never refused it, and with a memory cap that fits it. A tile
        nobody may take stays queued in place; the tiles behind it still go out.

        ``prefers(worker_id, ticket)`` (optional): a worker among the next few in turn for
        which it is true (one that already holds an operand block of the tile, say) takes
        the tile ahead of its turn.

        The caller's predictions (as for speculate: `finish_at(worker_id, tile_id)` for
        tiles a worker holds, `run_time(worker_id, ticket)` from handing it over to its
        result) decide steals: a worker with a free slot takes another's planned tile
        only when it would return it before that worker, counting each from when it is
        free of what it holds and, for the planned worker, of its planned tiles ahead;
        `busy_time(worker_id, ticket)` (default: run_time) is what a tile adds behind
        other tiles, less than its run time where transfers overlap compute.
        With `SchedulerConfig.leave_for_faster` they also make a worker pass on a fresh
        tile of the common queue that another worker would return that many times
        sooner; the tile waits for that worker.
        """
        if self._queued == 0 or not self._ready:
            return []
        assignments: list[Assignment] = []
        ring = deque(self._workers[worker_id] for worker_id in self._ready)
        if self._planned:
            for worker in ring:
                assignments.extend(self._take_planned(worker, now))
            ring = deque(worker for worker in ring if worker.free_slots() > 0)
        if self._queue and ring:
            assignments.extend(self._assign_common(ring, now, prefers, finish_at, run_time))
        if self._planned and ring:
            assignments.extend(self._steal(ring, now, finish_at, run_time, busy_time))
        # Workers still in the ring keep their turn order for the next call.
        self._ready = dict.fromkeys(worker.worker_id for worker in ring)
        return assignments

    def _take_planned(self, worker: _Worker, now: float) -> list[Assignment]:
        """The worker's own planned tiles, in plan order, into its free slots."""
        queue = self._planned.get(worker.worker_id)
        assignments = []
        while queue and worker.free_slots() > 0:
            tile = self._live_queue_entry(queue.popleft())
            if tile is not None:
                assignments.append(self._dequeue_to(tile, worker, now))
        if queue is not None and not queue:
            del self._planned[worker.worker_id]
        return assignments

    def _assign_common(
        self,
        ring: deque[_Worker],
        now: float,
        prefers: Callable[[str, TileTicket], bool] | None,
        finish_at: Callable[[str, str], float] | None,
        run_time: Callable[[str, TileTicket], float] | None,
    ) -> list[Assignment]:
        """The common queue, FIFO; rotates `ring` and drops the workers it fills."""
        slower = self._slower_filter(now, finish_at, run_time)
        largest_cap = _largest_cap(ring)
        assignments: list[Assignment] = []
        passed_over: list[tuple[str, int]] = []
        while ring and self._queue:
            entry = self._queue.popleft()
            tile = self._live_queue_entry(entry)
            if tile is None:
                continue
            worker = None
            if largest_cap is None or tile.ticket.wire_bytes <= largest_cap:
                worker = _next_taker(ring, tile, prefers, slower)
            if worker is None:
                passed_over.append(entry)
                continue
            assignments.append(self._dequeue_to(tile, worker, now))
        self._queue.extendleft(reversed(passed_over))
        return assignments

    def _steal(
        self,
        ring: deque[_Worker],
        now: float,
        finish_at: Callable[[str, str], float] | None,
        run_time: Callable[[str, TileTicket], float] | None,
        busy_time: Callable[[str, TileTicket], float] | None,
    ) -> list[Assignment]:
        """Workers in `ring` with free slots take planned tiles of others, from the back
        of the queue whose last tile would be back latest, while they would return it
        sooner than its planned worker. Without predictions: from the longest queue.
        Drops the workers it fills from `ring`. O(owners + steals x log owners), plus
        the predictions."""
        predict = finish_at is not None and run_time is not None
        free: dict[str, float] = {}  # seconds from now until a worker is free of its tiles

        def free_in(worker_id: str) -> float:
            if worker_id not in free:
                held = self._workers[worker_id].in_flight
                assert finish_at is not None
                free[worker_id] = max([0.0, *(finish_at(worker_id, t) - now for t in held)])
            return free[worker_id]

        def seconds(worker_id: str, ticket: TileTicket) -> float:
            return run_time(worker_id, ticket) if run_time is not None else 1.0

        def added(worker_id: str, ticket: TileTicket) -> float:
            """What a tile adds behind others: transfers overlap compute then. Without
            predictions every tile counts 1, so backlogs are queue lengths."""
            return (busy_time or seconds)(worker_id, ticket) if predict else 1.0

        # When each planned worker would return its last planned tile (seconds from
        # now), latest first; stale entries are dropped here, so none are met below.
        heap: list[tuple[float, str]] = []
        for owner in list(self._planned):
            live = [e for e in self._planned[owner] if self._live_queue_entry(e) is not None]
            if not live:
                del self._planned[owner]
                continue
            self._planned[owner] = deque(live)
            tickets = [self._tiles[tile_id].ticket for tile_id, _ in live]
            end = sum(added(owner, t) for t in tickets)
            if predict:
                end = max(free_in(owner) + end, seconds(owner, tickets[-1]))
            heap.append((-end, owner))
        heapq.heapify(heap)
        assignments: list[Assignment] = []
        takers = deque(ring)
        while takers and heap:
            worker = takers[0]
            neg_end, owner = heap[0]
            queue = self._planned[owner]
            if not queue:
                del self._planned[owner]
                heapq.heappop(heap)
                continue
            tile = self._tiles[queue[-1][0]]
            took = False
            if owner != worker.worker_id and _may_take(worker, tile):
                theirs = -neg_end
                mine = 0.0
                if predict:
                    mine = max(
                        free_in(worker.worker_id) + added(worker.worker_id, tile.ticket),
                        seconds(worker.worker_id, tile.ticket),
                    )
                if not predict or mine * STEAL_MARGIN < theirs:
                    queue.pop()
                    assignments.append(self._dequeue_to(tile, worker, now))
                    free[worker.worker_id] = mine
                    heapq.heapreplace(heap, (added(owner, tile.ticket) - theirs, owner))
                    took = True
            if not took or worker.free_slots() == 0:
                takers.popleft()
        if assignments:
            full = [worker for worker in ring if worker.free_slots() == 0]
            for worker in full:
                ring.remove(worker)
        return assignments

    def _dequeue_to(self, tile: _Tile, worker: _Worker, now: float) -> Assignment:
        tile.queue_token = None
        self._queued -= 1
        return self._hand_out(tile, worker, now)

    def _slower_filter(
        self,
        now: float,
        finish_at: Callable[[str, str], float] | None,
        run_time: Callable[[str, TileTicket], float] | None,
    ) -> Callable[[_Worker, _Tile], bool] | None:
        """`slower(worker, tile)` for one assign call: True when another worker would
        return the fresh tile `leave_for_faster` times sooner. Each worker's free time is
        predicted once per call, the soonest return once per tile size."""
        ratio = self._config.leave_for_faster
        if ratio is None or finish_at is None or run_time is None:
            return None
        active = [w for w in self._workers.values() if not w.paused]
        free = {
            w.worker_id: max([now, *(finish_at(w.worker_id, t) for t in w.in_flight)])
            for w in active
        }
        soonest: dict[tuple[int, int, int], float] = {}

        def eta(worker: _Worker, ticket: TileTicket) -> float:
            return free[worker.worker_id] - now + run_time(worker.worker_id, ticket)

        def slower(worker: _Worker, tile: _Tile) -> bool:
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

    def complete(self, worker_id: str, tile_id: str, now: float) -> Completion:
        """A result passed verification. The first one for a tile wins.

        A holder whose deadline passed, or that paused after taking the tile, still wins
        if the tile is not done yet. A worker that was removed never wins.
        """
        worker = self._workers.get(worker_id)
        tile = self._tiles.get(tile_id)
        if worker is not None:
            self._touch(worker, now)
            if tile is not None and (worker_id in tile.holders or worker_id in tile.released_to):
                cancel = self._retire(tile, winner=worker_id)
                self._mark_done(tile.ticket)
                self._bump("completed")
                return Completion(Verdict.ACCEPTED, tuple(cancel))
        if tile_id in self._done or (worker is not None and tile_id in worker.cancelled):
            self._bump("duplicates")
            return Completion(Verdict.DUPLICATE)
        return Completion(Verdict.NOT_ASSIGNED)

    def speculate(
        self,
        now: float,
        finish_at: Callable[[str, str], float],
        run_time: Callable[[str, TileTicket], float],
    ) -> list[Assignment]:
        """Copy late tiles to idle workers; returns the copies to send. Off (always [])
        unless `SchedulerConfig.speculate_after` is set.

        `finish_at(worker_id, tile_id)` predicts when a holder returns its tile (its queue
        and measured speed included); `run_time(worker_id, ticket)` predicts how long an
        idle worker needs from assignment to result. Both come from the caller's cost
        model. Only workers holding nothing count as idle, so a copy never waits behind
        other work. Latest tiles are rescued first, each by the idle worker that would
        return it soonest; a tile gets a copy when every holder's predicted finish is more
        than `speculate_after` times that worker's run time away. Queued tiles are left
        to assign(), which serves them anyway.
        """
        ratio = self._config.speculate_after
        if ratio is None:
            return []
        idle = [
            self._workers[worker_id]
            for worker_id in self._ready
            if not self._workers[worker_id].in_flight
        ]
        if not idle:
            return []
        late: list[tuple[float, str]] = []
        for tile_id, tile in self._tiles.items():
            if tile.queue_token is None and 0 < len(tile.holders) < self._config.max_holders:
                finish = min(finish_at(holder, tile_id) for holder in tile.holders)
                late.append((finish, tile_id))
        late.sort(key=lambda entry: (-entry[0], entry[1]))
        copies: list[Assignment] = []
        for finish, tile_id in late:
            if not idle:
                break
            tile = self._tiles[tile_id]
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
            copies.append(self._hand_out(tile, worker, now))
            self._refresh_ready(worker)
            self._bump("speculated")
        return copies

    def stranded(self) -> list[str]:
        """Queued tiles that no connected, unpaused worker may ever take: every one of
        them refused the tile, or it exceeds every one's memory cap. Waiting would wait
        forever, so the caller computes these itself. Empty while no worker is active
        (then waiting for one is right). O(queue): most tiles are ruled out in O(1)."""
        active = [w for w in self._workers.values() if not w.paused]
        if not active:
            return []
        caps = [w.mem_cap_bytes for w in active]
        largest_cap = None if None in caps else max(c for c in caps if c is not None)
        stranded = []
        for entry in self._queue:
            tile = self._live_queue_entry(entry)
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
        tile = self._tiles.get(tile_id)
        if tile is None:
            return []
        cancel = self._retire(tile, winner=None)
        self._mark_done(tile.ticket)
        self._bump("completed")
        return cancel

    def reject(self, worker_id: str, tile_id: str, now: float, *, reason: str) -> bool:
        """The worker refused the tile, or its result failed verification.

        The worker never gets this tile again. The tile goes to the front of the queue
        unless another worker holds it within its deadline; returns True if it is now
        at the front of the queue. `reason` is for the caller's logs only.
        """
        worker = self._workers.get(worker_id)
        tile = self._tiles.get(tile_id)
        if worker is None or tile is None:
            return False
        self._touch(worker, now)
        held = worker_id in tile.holders
        if not held and worker_id not in tile.released_to:
            return False
        tile.refused_by.add(worker_id)
        self._bump("rejected")
        if held:
            del tile.holders[worker_id]
            del worker.in_flight[tile_id]
            self._refresh_ready(worker)
        tile.released_to.discard(worker_id)
        worker.released.discard(tile_id)
        if tile.has_live_holder(now):
            return False
        self._requeue_front([tile_id])
        return True

    def expire(self, now: float) -> Expiry:
        """Remove workers whose last heartbeat is older than the timeout, then queue again
        the tiles whose deadline passed (their holders keep them and may still win)."""
        dead: list[str] = []
        requeued: list[str] = []
        limit = now - self._config.heartbeat_timeout_s
        while self._heartbeats and self._heartbeats[0][0] < limit:
            last_seen, incarnation, worker_id = heapq.heappop(self._heartbeats)
            worker = self._workers.get(worker_id)
            if worker is None or (worker.incarnation, worker.last_seen) != (incarnation, last_seen):
                continue
            dead.append(worker_id)
            requeued.extend(self._drop_worker(worker, now))
        overdue: dict[str, None] = {}  # ordered set: a tile may have several overdue holders
        while self._deadlines and self._deadlines[0][0] < now:
            _, seq, tile_id, worker_id = heapq.heappop(self._deadlines)
            tile = self._tiles.get(tile_id)
            holding = tile.holders.get(worker_id) if tile is not None else None
            if tile is None or holding is None or holding.seq != seq:
                continue  # stale entry: the tile or this assignment is gone
            if self._needs_requeue(tile, now):
                overdue[tile_id] = None
        self._requeue_front(list(overdue))
        return Expiry(tuple(dead), tuple(requeued) + tuple(overdue))

    def forget_gemm(self, gemm_id: str) -> list[tuple[str, str]]:
        """Drop every tile of a GEMM, queued, in flight or done.

        Returns (worker_id, tile_id) pairs whose holders the caller should cancel.
        """
        pairs: list[tuple[str, str]] = []
        for tile_id in self._tiles_by_gemm.pop(gemm_id, {}):
            tile = self._tiles[tile_id]
            pairs.extend((worker_id, tile_id) for worker_id in self._retire(tile, winner=None))
        for tile_id in self._done_by_gemm.pop(gemm_id, set()):
            del self._done[tile_id]
        return pairs

    # --- read-only views ----------------------------------------------------------------

    def in_flight(self, worker_id: str) -> frozenset[str]:
        worker = self._workers.get(worker_id)
        return frozenset(worker.in_flight) if worker is not None else frozenset()

    def queued_count(self) -> int:
        return self._queued

    def pending(self) -> int:
        """Tiles submitted and neither done nor forgotten."""
        return len(self._tiles)

    def is_done(self, tile_id: str) -> bool:
        return tile_id in self._done

    def workers(self) -> list[str]:
        return list(self._workers)

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(**self._counts)

    def check_invariants(self) -> None:
        """Raise RuntimeError if internal indexes disagree (for tests and the simulator)."""
        for problem in self._invariant_problems():
            raise RuntimeError(f"scheduler invariant broken: {problem}")

    # --- internals ----------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _bump(self, stat: str, by: int = 1) -> None:
        self._counts[stat] += by

    def _known(self, worker_id: str) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise UnknownWorkerError(worker_id)
        return worker

    def _touch(self, worker: _Worker, now: float) -> None:
        if now > worker.last_seen:
            worker.last_seen = now
            self._push_heartbeat(worker)

    def _push_heartbeat(self, worker: _Worker) -> None:
        heapq.heappush(self._heartbeats, (worker.last_seen, worker.incarnation, worker.worker_id))
        if len(self._heartbeats) > 2 * len(self._workers) + 64:
            self._heartbeats = [
                (w.last_seen, w.incarnation, w.worker_id) for w in self._workers.values()
            ]
            heapq.heapify(self._heartbeats)

    def _push_deadline(self, tile_id: str, worker_id: str, holding: _Holding) -> None:
        heapq.heappush(self._deadlines, (holding.deadline, holding.seq, tile_id, worker_id))
        if len(self._deadlines) > 2 * self._window_total + 64:
            self._deadlines = [
                (h.deadline, h.seq, tile.tile_id, holder)
                for tile in self._tiles.values()
                for holder, h in tile.holders.items()
            ]
            heapq.heapify(self._deadlines)

    def _refresh_ready(self, worker: _Worker) -> None:
        if not worker.paused and worker.free_slots() > 0:
            self._ready.setdefault(worker.worker_id, None)
        else:
            self._ready.pop(worker.worker_id, None)

    def _needs_requeue(self, tile: _Tile, now: float) -> bool:
        return tile.queue_token is None and not tile.has_live_holder(now)

    def _enqueue(self, tile: _Tile, *, front: bool) -> None:
        if tile.queue_token is None:
            self._queued += 1
        tile.queue_token = self._next_seq()
        entry = (tile.tile_id, tile.queue_token)
        owner = self._workers.get(tile.ticket.planned_for or "")
        fresh = not tile.times_assigned and not tile.refused_by
        if fresh and owner is not None and not owner.paused and owner.can_hold(tile.ticket):
            self._planned.setdefault(owner.worker_id, deque()).append(entry)
        elif front:
            self._queue.appendleft(entry)
        else:
            self._queue.append(entry)

    def _release_planned(self, worker_id: str) -> None:
        """The worker left or paused: its planned tiles go to the front of the common
        queue, in plan order (the GEMMs that wait on them are already late; the tiles
        it held go in front of them)."""
        queue = self._planned.pop(worker_id, deque())
        live = [entry for entry in queue if self._live_queue_entry(entry) is not None]
        self._queue.extendleft(reversed(live))

    def _requeue_front(self, tile_ids: list[str]) -> None:
        # Reversed so that the tiles keep their relative order at the front.
        for tile_id in reversed(tile_ids):
            self._enqueue(self._tiles[tile_id], front=True)

    def _live_queue_entry(self, entry: tuple[str, int]) -> _Tile | None:
        tile_id, token = entry
        tile = self._tiles.get(tile_id)
        return tile if tile is not None and tile.queue_token == token else None

    def _hand_out(self, tile: _Tile, worker: _Worker, now: float) -> Assignment:
        worker_id, tile_id = worker.worker_id, tile.tile_id
        holding = _Holding(now + self._config.tile_timeout_s, self._next_seq())
        tile.holders[worker_id] = holding
        tile.released_to.discard(worker_id)
        worker.released.discard(tile_id)
        worker.cancelled.pop(tile_id, None)
        worker.in_flight[tile_id] = None
        self._push_deadline(tile_id, worker_id, holding)
        reissue = tile.times_assigned > 0
        tile.times_assigned += 1
        if reissue:
            self._bump("reissued")
        return Assignment(worker_id, tile_id, holding.deadline, reissue)

    def _retire(self, tile: _Tile, *, winner: str | None) -> list[str]:
        """Take a finished or forgotten tile off every worker; returns holders to cancel."""
        tile_id = tile.tile_id
        to_cancel: list[str] = []
        for worker_id in tile.holders:
            worker = self._workers[worker_id]
            del worker.in_flight[tile_id]
            self._refresh_ready(worker)
            if worker_id != winner:
                to_cancel.append(worker_id)
                worker.remember_cancel(tile_id)
        for worker_id in tile.released_to:
            worker = self._workers[worker_id]
            worker.released.discard(tile_id)
            if worker_id != winner:
                worker.remember_cancel(tile_id)
        if tile.queue_token is not None:
            self._queued -= 1  # its queue entry is now stale
        del self._tiles[tile_id]
        gemm_tiles = self._tiles_by_gemm.get(tile.ticket.gemm_id)
        if gemm_tiles is not None:
            gemm_tiles.pop(tile_id, None)
            if not gemm_tiles:
                del self._tiles_by_gemm[tile.ticket.gemm_id]
        return to_cancel

    def _mark_done(self, ticket: TileTicket) -> None:
        self._done[ticket.tile_id] = ticket.gemm_id
        self._done_by_gemm.setdefault(ticket.gemm_id, set()).add(ticket.tile_id)

    def _drop_worker(self, worker: _Worker, now: float) -> list[str]:
        worker_id = worker.worker_id
        del self._workers[worker_id]
        self._ready.pop(worker_id, None)
        self._window_total -= worker.window
        lost: list[str] = []
        for tile_id in worker.in_flight:
            tile = self._tiles[tile_id]
            del tile.holders[worker_id]
            if self._needs_requeue(tile, now):
                lost.append(tile_id)
        for tile_id in worker.released:
            self._tiles[tile_id].released_to.discard(worker_id)
        self._release_planned(worker_id)
        self._requeue_front(lost)
        return lost

    def _invariant_problems(self) -> Iterable[str]:
        for worker_id, worker in self._workers.items():
            if worker.free_slots() < 0:
                yield f"{worker_id} holds {len(worker.in_flight)} > window {worker.window}"
            if worker.paused and worker.in_flight:
                yield f"paused {worker_id} holds tiles"
            if (worker_id in self._ready) != (not worker.paused and worker.free_slots() > 0):
                yield f"{worker_id} ready-set membership is wrong"
            for tile_id in worker.in_flight:
                if worker_id not in self._tiles[tile_id].holders:
                    yield f"{tile_id} in {worker_id}'s in-flight set but not held"
            for tile_id in worker.released:
                if worker_id not in self._tiles[tile_id].released_to:
                    yield f"{tile_id} released by {worker_id} but not mirrored"
        queued = 0
        for tile_id, tile in self._tiles.items():
            if tile_id in self._done:
                yield f"{tile_id} is both pending and done"
            for worker_id in tile.holders:
                if tile_id not in self._workers[worker_id].in_flight:
                    yield f"{tile_id} held by {worker_id} but not in its in-flight set"
            for worker_id in tile.released_to:
                if tile_id not in self._workers[worker_id].released:
                    yield f"{tile_id} released to {worker_id} but not mirrored"
            queued += tile.queue_token is not None
        entries = itertools.chain(self._queue, *self._planned.values())
        live_entries = sum(self._live_queue_entry(entry) is not None for entry in entries)
        for owner in self._planned:
            if owner not in self._workers or self._workers[owner].paused:
                yield f"tiles planned for {owner}, which is gone or paused"
        if not queued == live_entries == self._queued:
            yield f"queue count {self._queued}, tiles {queued}, live entries {live_entries}"
        if self._window_total != sum(w.window for w in self._workers.values()):
            yield "window total is wrong"


_STAT_NAMES = ("submitted", "completed", "reissued", "rejected", "duplicates", "speculated")


def _largest_cap(workers: Iterable[_Worker]) -> int | None:
    """The largest memory cap among workers, None when one of them has no cap."""
    largest = 0
    for worker in workers:
        if worker.mem_cap_bytes is None:
            return None
        largest = max(largest, worker.mem_cap_bytes)
    return largest


PREFERENCE_LOOKAHEAD = 16  # workers in turn checked for a preference: O(1) per tile
# A steal must promise to return the tile this many times sooner than its planned worker:
# it costs bytes the prediction does not see (the planned worker may hold an operand
# block already; the download shares the coordinator's uplink). In the simulator, on
# pools whose speeds were known, stealing on any predicted gain made GEMMs up to 20%
# slower on 10 Gbit/s links than never stealing; at 1.5 they were within 5% of it.
STEAL_MARGIN = 1.5


def _may_take(worker: _Worker, tile: _Tile) -> bool:
    return (
        worker.worker_id not in tile.refused_by
        and worker.worker_id not in tile.holders
        and worker.can_hold(tile.ticket)
    )


def _next_taker(
    ring: deque[_Worker],
    tile: _Tile,
    prefers: Callable[[str, TileTicket], bool] | None = None,
    slower: Callable[[_Worker, _Tile], bool] | None = None,
) -> _Worker | None:
    """The next worker in turn that may take the tile (or a preferred one among the next
    few), unless `slower` says another would return it much sooner; rotates the ring
    past it. A worker that fills its window leaves the ring."""

    def may(worker: _Worker) -> bool:
        return _may_take(worker, tile) and (slower is None or not slower(worker, tile))

    if prefers is not None:
        for i, worker in enumerate(itertools.islice(ring, PREFERENCE_LOOKAHEAD)):
            if prefers(worker.worker_id, tile.ticket) and may(worker):
                del ring[i]
                if worker.free_slots() > 1:
                    ring.append(worker)
                return worker
    for _ in range(len(ring)):
        worker = ring.popleft()
        if not may(worker):
            ring.append(worker)
            continue
        if worker.free_slots() > 1:
            ring.append(worker)
        return worker
    return None
