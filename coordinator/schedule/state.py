"""The scheduler's bookkeeping: its workers, tiles, queues and timeout heaps, and the
moves that keep those indexes consistent with one another. `Scheduler` (the public face)
and the assignment and speculation helpers act through these; see
coordinator.schedule.scheduler for the tile life cycle they implement."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Iterable, Iterator

from coordinator.schedule.records import (
    STAT_NAMES,
    Assignment,
    Holding,
    SchedulerConfig,
    TileRecord,
    TileTicket,
    UnknownWorkerError,
    WorkerRecord,
)

# A queue entry is (tile_id, token); it is live while the token matches the tile's.
QueueEntry = tuple[str, int]
# A ring entry is (turn, worker); it is live while the turn matches the worker's.
RingEntry = tuple[int, WorkerRecord]


class Largest:
    """A multiset of sizes that says its largest in O(log n): a count of each size, and
    a max-heap of them from which sizes no longer held are dropped when they surface."""

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()
        self._heap: list[int] = []  # negated

    def add(self, size: int) -> None:
        if not self._counts[size]:
            heapq.heappush(self._heap, -size)
        self._counts[size] += 1
        if len(self._heap) > 2 * len(self._counts) + 64:
            self._heap = [-kept for kept in self._counts]
            heapq.heapify(self._heap)

    def remove(self, size: int) -> None:
        self._counts[size] -= 1
        if not self._counts[size]:
            del self._counts[size]

    def counts(self) -> Counter[int]:
        return self._counts

    def largest(self) -> int | None:
        """None when it is empty."""
        heap = self._heap
        while heap and -heap[0] not in self._counts:
            heapq.heappop(heap)
        return -heap[0] if heap else None


class Caps:
    """The memory caps of a set of workers, kept as workers come and go."""

    def __init__(self) -> None:
        self._capped = Largest()
        self._uncapped = 0
        self.workers = 0

    def add(self, cap: int | None) -> None:
        self.workers += 1
        if cap is None:
            self._uncapped += 1
        else:
            self._capped.add(cap)

    def remove(self, cap: int | None) -> None:
        self.workers -= 1
        if cap is None:
            self._uncapped -= 1
        else:
            self._capped.remove(cap)

    def largest(self) -> int | None:
        """The largest cap; None when a worker has none, 0 when there are no workers."""
        return None if self._uncapped else (self._capped.largest() or 0)

    def counts(self) -> Counter[int | None]:
        """How many workers have each cap (None: no cap)."""
        counts: Counter[int | None] = Counter(self._capped.counts())
        if self._uncapped:
            counts[None] = self._uncapped
        return counts


class SchedulerState:
    """Everything one `Scheduler` knows; its indexes must agree (`invariant_problems`)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.workers: dict[str, WorkerRecord] = {}
        # Unpaused workers with a free slot, and the order they are served in: a ring of
        # (turn, worker) entries, live while the turn is the worker's own. A worker that
        # stops being ready where it is not at the front leaves a stale entry behind,
        # dropped when it comes round (or the ring is compacted): handing out a tile
        # then costs the same whether ten workers are free or ten thousand.
        self.ready: dict[str, None] = {}
        self.ring: deque[RingEntry] = deque()
        self.tiles: dict[str, TileRecord] = {}  # submitted and not done
        self.tiles_by_gemm: dict[str, dict[str, None]] = {}
        self.done: dict[str, str] = {}  # tile_id -> gemm_id, until the GEMM is forgotten
        self.done_by_gemm: dict[str, set[str]] = {}
        # An entry whose token no longer matches the tile's is stale and skipped, which
        # makes removal from the middle O(1).
        self.queue: deque[QueueEntry] = deque()
        # Fresh tiles planned for a worker, per worker, in plan order (same entries).
        self.planned: dict[str, deque[QueueEntry]] = {}
        self.queued = 0
        self._seq = 0
        # Min-heaps with lazy deletion: entries are checked against live state when popped.
        self._deadlines: list[tuple[float, int, str, str]] = []
        self._heartbeats: list[tuple[float, int, str]] = []
        self.window_total = 0
        # Kept as they change rather than found by reading every worker and every queued
        # tile: the memory caps of every worker and of the active (unpaused) ones, and
        # what `stranded` needs besides: the queued tiles' sizes and the refused tiles.
        self.caps = Caps()
        self.active_caps = Caps()
        self.queued_sizes = Largest()
        self.refused: dict[str, None] = {}
        self.counts = dict.fromkeys(STAT_NAMES, 0)

    def largest_cap(self) -> int | None:
        """The largest memory cap among the workers (None when one has none): no tile
        above it is worth offering to any of them."""
        return self.caps.largest()

    def joined(self, worker: WorkerRecord) -> None:
        self.workers[worker.worker_id] = worker
        self.caps.add(worker.mem_cap_bytes)
        self.active_caps.add(worker.mem_cap_bytes)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def bump(self, stat: str, by: int = 1) -> None:
        self.counts[stat] += by

    def known(self, worker_id: str) -> WorkerRecord:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise UnknownWorkerError(worker_id)
        return worker

    # --- liveness and deadlines ---------------------------------------------------------

    def touch(self, worker: WorkerRecord, now: float) -> None:
        if now > worker.last_seen:
            worker.last_seen = now
            self.push_heartbeat(worker)

    def push_heartbeat(self, worker: WorkerRecord) -> None:
        heapq.heappush(self._heartbeats, (worker.last_seen, worker.incarnation, worker.worker_id))
        if len(self._heartbeats) > 2 * len(self.workers) + 64:
            self._heartbeats = [
                (w.last_seen, w.incarnation, w.worker_id) for w in self.workers.values()
            ]
            heapq.heapify(self._heartbeats)

    def _push_deadline(self, tile_id: str, worker_id: str, holding: Holding) -> None:
        heapq.heappush(self._deadlines, (holding.deadline, holding.seq, tile_id, worker_id))
        if len(self._deadlines) > 2 * self.window_total + 64:
            self._deadlines = [
                (h.deadline, h.seq, tile.tile_id, holder)
                for tile in self.tiles.values()
                for holder, h in tile.holders.items()
            ]
            heapq.heapify(self._deadlines)

    def drop_silent_workers(self, now: float) -> tuple[list[str], list[str]]:
        """Remove workers whose last heartbeat is older than the timeout; returns them and
        the tiles that went back to the queue because of them."""
        dead: list[str] = []
        requeued: list[str] = []
        limit = now - self.config.heartbeat_timeout_s
        while self._heartbeats and self._heartbeats[0][0] < limit:
            last_seen, incarnation, worker_id = heapq.heappop(self._heartbeats)
            worker = self.workers.get(worker_id)
            if worker is None or (worker.incarnation, worker.last_seen) != (incarnation, last_seen):
                continue
            dead.append(worker_id)
            requeued.extend(self.drop_worker(worker, now))
        return dead, requeued

    def requeue_overdue(self, now: float) -> list[str]:
        """Queue again, at the front, the tiles whose deadline passed and that no holder
        holds within its deadline; returns them. Their holders keep them."""
        overdue: dict[str, None] = {}  # ordered set: a tile may have several overdue holders
        while self._deadlines and self._deadlines[0][0] < now:
            _, seq, tile_id, worker_id = heapq.heappop(self._deadlines)
            tile = self.tiles.get(tile_id)
            holding = tile.holders.get(worker_id) if tile is not None else None
            if tile is None or holding is None or holding.seq != seq:
                continue  # stale entry: the tile or this assignment is gone
            if self.needs_requeue(tile, now):
                overdue[tile_id] = None
        self.requeue_front(list(overdue))
        return list(overdue)

    # --- queues -------------------------------------------------------------------------

    def refresh_ready(self, worker: WorkerRecord) -> None:
        # A worker part-way through a refill (the tiles ran out) keeps its turn.
        if worker.paused or not worker.has_room():
            self.unready(worker)
        elif worker.wants_refill():
            self.make_ready(worker)

    def make_ready(self, worker: WorkerRecord) -> None:
        """A worker that was not ready is served after every ready one."""
        if worker.turn:
            return
        worker.turn = self.next_seq()
        self.ready[worker.worker_id] = None
        self.ring.append((worker.turn, worker))
        if len(self.ring) > 2 * len(self.ready) + 64:
            self.ring = deque(self.live_turns())

    def unready(self, worker: WorkerRecord) -> None:
        """The worker is full, paused or gone: its ring entry, wherever it is, is stale."""
        if worker.turn:
            worker.turn = 0
            del self.ready[worker.worker_id]

    def live_turns(self) -> Iterator[RingEntry]:
        """The ready workers' ring entries, in turn order."""
        return (entry for entry in self.ring if entry[0] == entry[1].turn)

    def drop_stale_turns(self) -> None:
        """Stale entries off the front of the ring, so that its head is live."""
        ring = self.ring
        while ring and ring[0][0] != ring[0][1].turn:
            ring.popleft()

    def needs_requeue(self, tile: TileRecord, now: float) -> bool:
        return tile.queue_token is None and not tile.has_live_holder(now)

    def enqueue(self, tile: TileRecord, *, front: bool) -> None:
        if tile.queue_token is None:
            self.queued += 1
            self.queued_sizes.add(tile.ticket.wire_bytes)
        tile.queue_token = self.next_seq()
        entry = (tile.tile_id, tile.queue_token)
        owner = self.workers.get(tile.ticket.planned_for or "")
        fresh = not tile.times_assigned and not tile.refused_by
        if fresh and owner is not None and not owner.paused and owner.can_hold(tile.ticket):
            self.planned.setdefault(owner.worker_id, deque()).append(entry)
        elif front:
            self.queue.appendleft(entry)
        else:
            self.queue.append(entry)

    def release_planned(self, worker_id: str) -> None:
        """The worker left or paused: its planned tiles go to the front of the common
        queue, in plan order (the GEMMs that wait on them are already late; the tiles
        it held go in front of them)."""
        queue = self.planned.pop(worker_id, deque())
        live = [entry for entry in queue if self.live_queue_entry(entry) is not None]
        self.queue.extendleft(reversed(live))

    def requeue_front(self, tile_ids: list[str]) -> None:
        # Reversed so that the tiles keep their relative order at the front.
        for tile_id in reversed(tile_ids):
            self.enqueue(self.tiles[tile_id], front=True)

    def live_queue_entry(self, entry: QueueEntry) -> TileRecord | None:
        tile_id, token = entry
        tile = self.tiles.get(tile_id)
        return tile if tile is not None and tile.queue_token == token else None

    # --- handing out and taking back ----------------------------------------------------

    def hand_out(self, tile: TileRecord, worker: WorkerRecord, now: float) -> Assignment:
        worker_id, tile_id = worker.worker_id, tile.tile_id
        holding = Holding(now + self.config.tile_timeout_s, self.next_seq())
        tile.holders[worker_id] = holding
        tile.released_to.discard(worker_id)
        worker.released.discard(tile_id)
        worker.cancelled.pop(tile_id, None)
        worker.hold(tile_id, tile.ticket)
        self._push_deadline(tile_id, worker_id, holding)
        reissue = tile.times_assigned > 0
        tile.times_assigned += 1
        if reissue:
            self.bump("reissued")
        return Assignment(worker_id, tile_id, holding.deadline, reissue)

    def dequeue_to(self, tile: TileRecord, worker: WorkerRecord, now: float) -> Assignment:
        """Hand out a queued tile whose queue entry the caller has taken off its queue."""
        tile.queue_token = None
        self.queued -= 1
        self.queued_sizes.remove(tile.ticket.wire_bytes)
        return self.hand_out(tile, worker, now)

    def retire(self, tile: TileRecord, *, winner: str | None) -> list[str]:
        """Take a finished or forgotten tile off every worker; returns holders to cancel."""
        tile_id = tile.tile_id
        to_cancel: list[str] = []
        for worker_id in tile.holders:
            worker = self.workers[worker_id]
            worker.let_go(tile_id)
            self.refresh_ready(worker)
            if worker_id != winner:
                to_cancel.append(worker_id)
                worker.remember_cancel(tile_id)
        for worker_id in tile.released_to:
            worker = self.workers[worker_id]
            worker.released.discard(tile_id)
            if worker_id != winner:
                worker.remember_cancel(tile_id)
        if tile.queue_token is not None:
            self.queued -= 1  # its queue entry is now stale
            self.queued_sizes.remove(tile.ticket.wire_bytes)
        self.refused.pop(tile_id, None)
        del self.tiles[tile_id]
        gemm_tiles = self.tiles_by_gemm.get(tile.ticket.gemm_id)
        if gemm_tiles is not None:
            gemm_tiles.pop(tile_id, None)
            if not gemm_tiles:
                del self.tiles_by_gemm[tile.ticket.gemm_id]
        return to_cancel

    def mark_done(self, ticket: TileTicket) -> None:
        self.done[ticket.tile_id] = ticket.gemm_id
        self.done_by_gemm.setdefault(ticket.gemm_id, set()).add(ticket.tile_id)

    def drop_worker(self, worker: WorkerRecord, now: float) -> list[str]:
        """Forget a worker; returns the tiles that went back to the queue because of it."""
        worker_id = worker.worker_id
        del self.workers[worker_id]
        self.caps.remove(worker.mem_cap_bytes)
        self.unready(worker)
        if not worker.paused:
            self.active_caps.remove(worker.mem_cap_bytes)
        self.window_total -= worker.window
        lost: list[str] = []
        for tile_id in worker.in_flight:
            tile = self.tiles[tile_id]
            del tile.holders[worker_id]
            if self.needs_requeue(tile, now):
                lost.append(tile_id)
        for tile_id in worker.released:
            self.tiles[tile_id].released_to.discard(worker_id)
        self.release_planned(worker_id)
        self.requeue_front(lost)
        return lost

    # --- self-check ---------------------------------------------------------------------

    def invariant_problems(self) -> Iterable[str]:
        yield from self._worker_problems()
        yield from self._tile_problems()

    def _worker_problems(self) -> Iterable[str]:
        live_turns = Counter(worker.worker_id for _, worker in self.live_turns())
        if any(worker is not self.workers.get(worker.worker_id) for _, worker in self.live_turns()):
            yield "a worker no longer registered has a live turn"
        for worker_id, worker in self.workers.items():
            # Its last tile may take it past its window by less than a slot's worth.
            over = worker.held >= worker.capacity + (worker.slot_flops or 1)
            if over or len(worker.in_flight) > worker.max_tiles:
                yield f"{worker_id} holds {len(worker.in_flight)} tiles: over its window"
            if worker.held != sum(worker.in_flight.values()):
                yield f"{worker_id}'s held share is not the sum of its tiles'"
            if worker.paused and worker.in_flight:
                yield f"paused {worker_id} holds tiles"
            ready = worker_id in self.ready
            if ready != bool(worker.turn) or live_turns[worker_id] != ready:
                yield f"{worker_id}'s turn in the ring does not match its being ready"
            if ready and (worker.paused or not worker.has_room()):
                yield f"{worker_id} is ready without room"
            if not ready and not worker.paused and worker.wants_refill():
                yield f"{worker_id} has room for a refill but is not ready"
            for tile_id in worker.in_flight:
                if worker_id not in self.tiles[tile_id].holders:
                    yield f"{tile_id} in {worker_id}'s in-flight set but not held"
            for tile_id in worker.released:
                if worker_id not in self.tiles[tile_id].released_to:
                    yield f"{tile_id} released by {worker_id} but not mirrored"

    def _tile_problems(self) -> Iterable[str]:
        queued = 0
        for tile_id, tile in self.tiles.items():
            if tile_id in self.done:
                yield f"{tile_id} is both pending and done"
            for worker_id in tile.holders:
                if tile_id not in self.workers[worker_id].in_flight:
                    yield f"{tile_id} held by {worker_id} but not in its in-flight set"
            for worker_id in tile.released_to:
                if tile_id not in self.workers[worker_id].released:
                    yield f"{tile_id} released to {worker_id} but not mirrored"
            queued += tile.queue_token is not None
        entries = itertools.chain(self.queue, *self.planned.values())
        live_entries = sum(self.live_queue_entry(entry) is not None for entry in entries)
        for owner in self.planned:
            if owner not in self.workers or self.workers[owner].paused:
                yield f"tiles planned for {owner}, which is gone or paused"
        if not queued == live_entries == self.queued:
            yield f"queue count {self.queued}, tiles {queued}, live entries {live_entries}"
        if self.window_total != sum(w.window for w in self.workers.values()):
            yield "window total is wrong"
        for caps, workers in (
            (self.caps, list(self.workers.values())),
            (self.active_caps, [w for w in self.workers.values() if not w.paused]),
        ):
            if caps.workers != len(workers) or caps.counts() != Counter(
                w.mem_cap_bytes for w in workers
            ):
                yield "the workers' memory caps are wrong"
        sizes = Counter(t.ticket.wire_bytes for t in self.tiles.values() if t.queue_token)
        if self.queued_sizes.counts() != sizes:
            yield "queued tiles' sizes are wrong"
        if any(t.refused_by and t.tile_id not in self.refused for t in self.tiles.values()):
            yield "a refused tile is not among the refused"
