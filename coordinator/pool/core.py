"""The coordinator's decisions, without I/O: who gets which tile, what each worker message
does, when a worker is dropped, credited, cancelled or banned.

``CoordinatorCore`` takes inputs (a worker admitted, a frame received, a check finished,
a tile delivered, a tick, tiles submitted), each with the time it happens, and answers
each with one ``Effects`` value: frames to send per worker, connections to close, results
to check, verified tiles to deliver, tiles to compute here. It opens no socket, starts no
thread and reads no clock of its own (the ledger it is given records credit and bans as
they happen, so a crash loses none). The live server (``coordinator.serve.server``) and
the simulator (``coordinator.sim.engine``) both drive this one class, so what the
simulator reports is what the server decides.

A worker's frames leave in the order the core emits them, through one write path per
connection: a heartbeat's ack or a verdict never overtakes the tasks queued before it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.batches import Batch, inner_frames
from common.block_cache import BlockCache
from common.errors import ErrorCode, FrameError, LimitExceeded, ProtocolError
from common.frames import Buffer
from common.limits import DEFAULT_LIMITS, WireLimits
from common.messages import (
    Cancel,
    Error,
    Hello,
    JobState,
    Message,
    Result,
    encode_message,
    parse_message,
)
from common.signing import fingerprint
from common.token_bucket import TokenBucket
from coordinator.plan.estimates import (
    DeviceEstimate,
    from_profile,
)
from coordinator.pool.effects import Check, Checked, CloseCode, Effects, Send
from coordinator.pool.handlers import HANDLERS, on_result
from coordinator.pool.ledger import Ledger
from coordinator.pool.predictions import Predictions
from coordinator.pool.reputation import (
    ReputationPolicy,
)
from coordinator.pool.status import core_status
from coordinator.pool.verdicts import judge, placed_anyway
from coordinator.pool.workers import Counters, PoolView, Worker, WorkerState
from coordinator.schedule.scheduler import (
    SHARED_SLOT_FLOPS,
    Assignment,
    Scheduler,
    SchedulerConfig,
)

log = logging.getLogger("cleave.coordinator")

MIN_PLANNING_MEMORY_CAP = 16 << 20
# A link speed to start from until a worker's first tiles measure its own: a modest
# home connection, so early estimates err on the slow side.
LINK_GUESS_BYTES_PER_S = 10e6
MAX_PREDICTED_WORKERS = 256


@dataclass(frozen=True)
class CoreConfig:
    heartbeat_interval_s: float = 2.0
    # Messages per second from one worker, with a burst allowance. A worker sends a
    # heartbeat every few seconds and one result per tile; hundreds a second is abuse.
    max_messages_per_s: float = 200.0
    message_burst: int = 400
    reputation: ReputationPolicy = field(default_factory=ReputationPolicy)
    limits: WireLimits = DEFAULT_LIMITS
    scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(slot_flops=SHARED_SLOT_FLOPS)
    )
    link_guess_bytes_per_s: float = LINK_GUESS_BYTES_PER_S


class CoordinatorCore:
    def __init__(
        self,
        *,
        key: Ed25519PrivateKey,
        ledger: Ledger,
        config: CoreConfig = CoreConfig(),
        wall_clock: Callable[[], float] | None = None,
    ) -> None:
        self.key = key
        self.ledger = ledger
        self.config = config
        # Ledger rows carry wall-clock times; by default the time the core is given.
        self._wall_clock = wall_clock
        self.scheduler = Scheduler(config.scheduler)
        self.counters = Counters()
        self.workers: dict[str, Worker] = {}
        self.tiles: dict[str, Any] = {}  # tile id -> Tile, until it is verified or taken over
        self._pool = PoolView()
        self._pool_stale = False
        self.predict = Predictions(self.workers, self.tiles, self.scheduler, lambda: self.now)
        self._estimates_moved = False
        # How far the training has come and why workers may wait (signed once per
        # change): each worker is sent the newest one as it joins and with its next ack.
        self.job_state: JobState | None = None
        self._job_state_frame = b""
        self._ids = itertools.count(1)
        self.now = 0.0

    # ---- queries -----------------------------------------------------------------------

    def active_workers(self) -> int:
        return sum(1 for w in self.workers.values() if not w.paused)

    @property
    def pool(self) -> PoolView:
        """The pool as it stands, for the planner. Made in one pass over the workers when
        read after joins, leaves, pauses or moved estimates, however many there were: a
        pass per join cost the event loop a pass over each of a thousand workers
        reconnecting at once. Read it on the core's thread; other threads read the view
        their server last took from here."""
        if self._pool_stale:
            self._pool = self._pool_view()
            self._pool_stale = self._estimates_moved = False
        return self._pool

    @property
    def pool_stale(self) -> bool:
        return self._pool_stale

    def pool_changed(self) -> None:
        """A worker joined, left, paused or resumed: the next read of ``pool`` makes it
        anew."""
        self._pool_stale = True

    def refusal(self, hello: Hello) -> str:
        """Why this worker may not join (its key is banned), or ''."""
        standing = self.ledger.get(hello.worker_key)
        if standing.banned_reason:
            return f"worker {fingerprint(hello.worker_key)} is banned: {standing.banned_reason}"
        return ""

    def next_worker_id(self) -> str:
        return f"w{next(self._ids)}"

    def set_estimate(self, worker_id: str, estimate: DeviceEstimate) -> None:
        """What the core knows of a worker's speed and links, told from outside (the
        simulator's pool whose true speeds are known, as if learnt)."""
        self.workers[worker_id].estimate = estimate
        self.pool_changed()

    # ---- inputs ------------------------------------------------------------------------

    def admit(self, worker_id: str, hello: Hello, now: float) -> Effects:
        """Register a worker whose handshake completed (the Welcome is out)."""
        self.now = now
        estimate = from_profile(
            worker_id,
            hello.profile,
            down_bps=self.config.link_guess_bytes_per_s,
            up_bps=self.config.link_guess_bytes_per_s,
            now=now,
        )
        worker = Worker(
            worker_id,
            hello.worker_key,
            hello.name,
            hello.profile,
            hello.window,
            now,
            last_seen=now,
            messages=TokenBucket(
                self.config.max_messages_per_s,
                self.config.message_burst,
                clock=lambda: self.now,
            ),
            estimate=estimate,
            blocks=BlockCache(hello.cache_bytes, int),
        )
        self.workers[worker_id] = worker
        self.scheduler.add_worker(
            worker_id,
            window=worker.window,
            now=now,
            mem_cap_bytes=worker.profile.mem_cap_bytes or None,
        )
        self.pool_changed()
        log.info(
            "worker %s joined as %s: %s, %d threads, %.0f GFLOP/s",
            worker.who,
            worker_id,
            worker.profile.device_name or worker.profile.device,
            worker.profile.threads,
            worker.profile.gflops,
        )
        effects = Effects(workers_changed=True)
        self.tell_job_state(worker, effects)
        self.dispatch(effects)
        return effects

    def set_job_state(self, state: JobState) -> None:
        """A new signed JobState for every worker; it reaches each with its next ack."""
        self.job_state = state
        self._job_state_frame = encode_message(state)  # one encoding for every worker

    def tell_job_state(self, worker: Worker, effects: Effects) -> None:
        state = self.job_state
        if state is not None and worker.job_state is not state:
            worker.job_state = state
            effects.sends.append(Send(worker.worker_id, frame=self._job_state_frame))

    def submit(self, tiles: Iterable[Any], now: float) -> Effects:
        """Queue a GEMM's tiles."""
        self.now = now
        tiles = list(tiles)
        for tile in tiles:
            self.tiles[tile.tile_id] = tile
        self.scheduler.submit(tile.ticket for tile in tiles)
        effects = Effects()
        self.dispatch(effects)
        return effects

    def kept_here(self, gemm_id: str, tiles: int, finished: bool, now: float) -> Effects:
        """The training thread computed ``tiles`` of a GEMM itself; ``finished``: its last
        tile was one of them, so no result will close the GEMM."""
        self.now = now
        self.counters.kept_here += tiles
        effects = Effects()
        if finished:
            self._forget_gemm(gemm_id, effects)
        return effects

    def receive(self, worker_id: str, data: str | bytes | bytearray, now: float) -> Effects:
        """One WebSocket message from a connected worker: a frame, or a batch of them
        (one message of the rate allowance: a batch's size has its own limit)."""
        self.now = now
        effects = Effects()
        worker = self.workers.get(worker_id)
        if worker is None:
            # Forgotten (expired, banned) while this frame waited in the socket buffer:
            # its tiles are already re-issued; the connection is on its way out.
            effects.close(worker_id, CloseCode.TIMEOUT, "heartbeat timeout")
            return effects
        worker.last_seen = now
        # Any frame shows the worker is alive, even one that waits behind a slow check.
        self.scheduler.heartbeat(worker_id, now)
        if isinstance(data, str):
            return self.drop(worker, CloseCode.POLICY, "text frames are not part of the protocol")
        if worker.messages is not None and worker.messages.reserve(1) > 0.0:
            limit = self.config.max_messages_per_s
            effects.send(
                worker_id,
                Error(ErrorCode.RATE_LIMITED, f"more than max_messages_per_s={limit:g} messages"),
            )
            return self.drop(
                worker, CloseCode.POLICY, f"message rate over max_messages_per_s={limit:g}", effects
            )
        self._take(worker, data, effects)
        return effects

    def _take(self, worker: Worker, data: Buffer, effects: Effects, inner: bool = False) -> bool:
        """One frame (or each frame of a batch, in order); False once the worker is
        dropped, so nothing after that frame is taken."""
        worker_id = worker.worker_id
        try:
            received = parse_message(data, self.config.limits)
            if isinstance(received.message, Batch):
                if inner:
                    raise FrameError("a batch inside a batch")
                frames = inner_frames(received)
        except (FrameError, LimitExceeded) as exc:
            effects.send(worker_id, Error(exc.code, exc.message))
            self.drop(worker, CloseCode.POLICY, exc.message, effects)
            return False
        except ProtocolError as exc:
            # Well-framed but not understood (unknown type, bad fields): say so, keep going.
            effects.send(worker_id, Error(exc.code, exc.message))
            return True
        msg = received.message
        if isinstance(msg, Batch):
            return all(
                self._take(worker, frame, effects, inner=True)
                and self.workers.get(worker_id) is worker
                for frame in frames
            )
        if isinstance(msg, Result):
            # Its tensor is decoded with the check, off the event loop.
            on_result(self, worker, msg, received, len(received.frame.payload), effects)
            return True
        handler = HANDLERS.get(type(msg))
        if handler is None:
            effects.send(
                worker_id, Error(ErrorCode.UNEXPECTED_MESSAGE, f"{msg.TYPE} is not sent by workers")
            )
            return True
        handler(self, worker, msg, effects)
        return True

    def handle(self, worker_id: str, msg: Message, now: float) -> Effects:
        """One decoded message from a connected worker, without the frame (the
        simulator's input); a ``Result`` here carries no tensor to check."""
        self.now = now
        effects = Effects()
        worker = self.workers.get(worker_id)
        if worker is None:
            return effects
        worker.last_seen = now
        self.scheduler.heartbeat(worker_id, now)
        if isinstance(msg, Result):
            ticket = self.tiles[msg.tile_id].ticket if msg.tile_id in self.tiles else None
            on_result(self, worker, msg, None, ticket.up_bytes if ticket else 0, effects)
        else:
            HANDLERS[type(msg)](self, worker, msg, effects)
        return effects

    def checked(self, check: Check, outcome: Checked, now: float) -> Effects:
        """A result's check finished; if it passed, the tile is already in its GEMM."""
        self.now = now
        effects = Effects()
        worker = self.workers.get(check.worker_id)
        if worker is None:
            # It left (or was banned) while the check ran: its tiles are already
            # re-issued, and a verdict on it would count twice.
            self.counters.duplicates += 1
            placed_anyway(self, check, outcome, effects)
        elif judge(self, worker, check, outcome, effects):
            self._estimates_moved = True
        if outcome.finished:  # after the credit: stragglers' copies of its tiles go
            self._forget_gemm(check.tile.ticket.gemm_id, effects)
        return effects

    def delivered(self, tile: Any, finished: bool, now: float) -> Effects:
        """A tile computed here is in its GEMM; ``finished``: the GEMM is."""
        self.now = now
        effects = Effects()
        if finished:
            self._forget_gemm(tile.ticket.gemm_id, effects)
        return effects

    def disconnected(self, worker_id: str, now: float) -> Effects:
        """The connection is gone (closed by either side): its tiles move on."""
        self.now = now
        effects = Effects()
        worker = self.workers.get(worker_id)
        if worker is not None:
            self.forget(worker, effects)
        return effects

    def tick(self, now: float) -> Effects:
        """The expiry timer: drop workers that missed their heartbeats, re-issue lost
        tiles, copy late ones, compute stranded ones here."""
        self.now = now
        effects = Effects()
        expiry = self.scheduler.expire(now)
        for worker_id in expiry.dead_workers:
            worker = self.workers.get(worker_id)
            if worker is not None:
                log.warning("worker %s missed its heartbeats: dropping it", worker.name)
                effects.close(worker_id, CloseCode.TIMEOUT, "heartbeat timeout")
                self.forget(worker, effects)
        if expiry.requeued:
            self.dispatch(effects)
        self._speculate(effects)
        self.rescue_stranded(effects)
        if self._estimates_moved:
            self.pool_changed()
        return effects

    # ---- decisions -----------------------------------------------------------------------

    def drop(
        self, worker: Worker, code: CloseCode, reason: str, effects: Effects | None = None
    ) -> Effects:
        """Close this one connection with a reason; its tiles move on now, not when the
        close handshake ends (that can take a while behind a flooded receive buffer)."""
        effects = effects if effects is not None else Effects()
        if code != CloseCode.NORMAL:
            log.warning("closing %s (%s): %s", worker.worker_id, worker.who, reason)
        effects.close(worker.worker_id, code, reason)
        self.forget(worker, effects)
        return effects

    def forget(self, worker: Worker, effects: Effects) -> None:
        if self.workers.pop(worker.worker_id, None) is None:
            return
        self.pool_changed()
        if worker.worker_id in self.scheduler.workers():
            requeued = self.scheduler.remove_worker(worker.worker_id, self.now)
            if requeued:
                log.info(
                    "worker %s left with %d tiles in flight: re-queued", worker.name, len(requeued)
                )
        effects.workers_changed = True
        self.dispatch(effects)
        self.rescue_stranded(effects)

    def _pool_view(self) -> PoolView:
        """One pass over the workers."""
        active = 0
        estimates: list[DeviceEstimate] = []
        # The smallest cap, so any worker can take any tile. Caps below a floor are
        # left out: one volunteer must not shred every GEMM into crumbs; the scheduler
        # gives that worker no tile over its cap, and tiles nobody can take are
        # computed here.
        cap: int | None = None
        paused = WorkerState.PAUSED  # Worker.paused, without a property call per worker
        for w in self.workers.values():
            mem_cap = w.profile.mem_cap_bytes
            if mem_cap >= MIN_PLANNING_MEMORY_CAP and (cap is None or mem_cap < cap):
                cap = mem_cap
            if w.state != paused:
                active += 1
                if w.estimate is not None:
                    estimates.append(w.estimate)
        return PoolView(
            workers=len(self.workers), active=active, estimates=tuple(estimates), memory_cap=cap
        )

    def dispatch(self, effects: Effects) -> None:
        # Steals of planned tiles and earliest-finish holds (leave_for_faster) cost a
        # prediction per worker per call: past a few hundred workers, the planned workers
        # first, then the pull order, decide.
        timed = len(self.workers) <= MAX_PREDICTED_WORKERS
        for assignment in self.scheduler.assign(self.now, self.predict, timed=timed):
            self._send(assignment, effects)

    def _send(self, assignment: Assignment, effects: Effects) -> None:
        worker = self.workers.get(assignment.worker_id)
        tile = self.tiles.get(assignment.tile_id)
        if worker is None or tile is None:  # pragma: no cover - scheduler and maps agree
            log.error(
                "scheduler assigned %s to %s, which is unknown",
                assignment.tile_id,
                assignment.worker_id,
            )
            return
        held = self.scheduler.in_flight(worker.worker_id)
        if len(worker.sent_at) > 4 * worker.window + 8:
            # Tiles cancelled or moved elsewhere leave their send times behind: keep
            # only those of tiles the worker still holds, so a long session stays small.
            worker.sent_at = {t: at for t, at in worker.sent_at.items() if t in held}
            worker.sent_bytes = {t: n for t, n in worker.sent_bytes.items() if t in held}
            worker.sent_idle &= held
        if not any(t in worker.sent_at for t in held if t != tile.tile_id):
            # Nothing sent ahead of it (tiles assigned with it go out after it): its
            # round trip is transfer and compute alone.
            worker.sent_idle.add(tile.tile_id)
        frame = worker.task_frame(tile, self.key)
        effects.sends.append(Send(worker.worker_id, frame, tile.tile_id))
        worker.sent_at[tile.tile_id] = self.now
        worker.sent_bytes[tile.tile_id] = len(frame)
        self.counters.tiles_sent += 1
        self.counters.reissued += assignment.reissue
        self.counters.bytes_down += len(frame)
        self.counters.bytes_down_uncached += len(tile.bundle)
        if tile.half:
            self.counters.bytes_half += len(frame)

    def _speculate(self, effects: Effects) -> None:
        """Copy tiles predicted late (a slow or withholding worker) to idle workers; the
        first verified result wins and the other holder is cancelled."""
        for copy in self.scheduler.speculate(self.now, self.predict):
            log.info("tile %s looks late: a copy goes to %s", copy.tile_id, copy.worker_id)
            self.counters.speculated += 1
            self._send(copy, effects)

    def _forget_gemm(self, gemm_id: str, effects: Effects) -> None:
        # Keeps the scheduler's record of done tiles bounded by the GEMMs in flight.
        for worker_id, tile_id in self.scheduler.forget_gemm(gemm_id):
            self.cancel(worker_id, tile_id, effects)

    def rescue_stranded(self, effects: Effects) -> None:
        """Compute here the tiles that no connected worker may take (all refused them,
        or they exceed every memory cap): waiting for them would wait forever."""
        for tile_id in self.scheduler.stranded():
            for worker_id in self.scheduler.take_over(tile_id):
                self.cancel(worker_id, tile_id, effects)
            tile = self.tiles.pop(tile_id, None)
            if tile is None:  # pragma: no cover - the scheduler and the tile map agree
                continue
            self.counters.computed_here += 1
            self.counters.flops_computed_here += tile.flops
            log.warning(
                "no connected worker may take tile %s (refused by all, or over every memory "
                "cap): computing it at the coordinator",
                tile_id,
            )
            effects.compute_here.append(tile)

    def cancel(self, worker_id: str, tile_id: str, effects: Effects) -> None:
        if worker_id in self.workers:
            effects.send(worker_id, Cancel(tile_id))

    def wall_time(self) -> float:
        return self._wall_clock() if self._wall_clock is not None else self.now

    # ---- status --------------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        return core_status(self, now)
