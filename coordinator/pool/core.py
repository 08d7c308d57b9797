"""The coordinator's decisions, without I/O: who gets which tile, what each worker message
does, when a worker is dropped, credited, cancelled or banned.

``CoordinatorCore`` takes inputs (a worker admitted, a frame received, a check finished,
a tile delivered, a tick, tiles submitted), each with the time it happens, and answers
each with one ``Effects`` value: frames to send per worker, connections to close, results
to check, verified tiles to deliver, tiles to compute here. It opens no socket, starts no
thread and reads no clock; the live server (``coordinator.serve.server``) and the simulator
(``coordinator.sim.engine``) both drive this one class, so what the simulator reports is
what the server decides.

A worker's frames leave in the order the core emits them, through one write path per
connection: a heartbeat's ack or a verdict never overtakes the tasks queued before it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any, Protocol

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.block_cache import BlockCache
from common.errors import FrameError, LimitExceeded, ProtocolError
from common.limits import DEFAULT_LIMITS, WireLimits
from common.messages import (
    Ack,
    Bye,
    Cancel,
    DeviceProfile,
    Error,
    Heartbeat,
    Hello,
    Message,
    Pause,
    Result,
    Resume,
    encode_message,
    parse_message,
)
from common.signing import fingerprint
from common.token_bucket import TokenBucket
from coordinator.plan.costmodel import (
    DeviceEstimate,
    TileObservation,
    from_profile,
    observe,
    overdue_finish,
    queued_start,
)
from coordinator.pool.ledger import Ledger
from coordinator.pool.reputation import (
    ReputationPolicy,
    after_failed,
    after_verified,
    ban_reason,
    is_banned,
)
from coordinator.schedule.scheduler import (
    Assignment,
    Scheduler,
    SchedulerConfig,
    TileTicket,
    Verdict,
)
from coordinator.tiles.verify import CheckResult

log = logging.getLogger("cleave.coordinator")

MIN_PLANNING_MEMORY_CAP = 16 << 20
# A link speed to start from until a worker's first tiles measure its own: a modest
# home connection, so early estimates err on the slow side.
LINK_GUESS_BYTES_PER_S = 10e6
MAX_PREDICTED_WORKERS = 256


class CloseCode(IntEnum):
    NORMAL = 1000
    POLICY = 1008  # RFC 6455: policy violation (malformed or forbidden messages)
    TRY_LATER = 1013  # RFC 6455: try again later (too many handshakes at once)
    TIMEOUT = 4000  # application code: missed heartbeats


class WorkerState(str, Enum):
    """What a worker said it is doing (``common.messages.WORKER_STATES``)."""

    WORKING = "working"
    IDLE = "idle"
    PAUSED = "paused"


@dataclass(frozen=True)
class CoreConfig:
    heartbeat_interval_s: float = 2.0
    # Messages per second from one worker, with a burst allowance. A worker sends a
    # heartbeat every few seconds and one result per tile; hundreds a second is abuse.
    max_messages_per_s: float = 200.0
    message_burst: int = 400
    reputation: ReputationPolicy = field(default_factory=ReputationPolicy)
    limits: WireLimits = DEFAULT_LIMITS
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    link_guess_bytes_per_s: float = LINK_GUESS_BYTES_PER_S


class Tile(Protocol):
    """One tile as the core needs it: ``coordinator.tiles.tiled_gemm.TileJob`` on the server, a
    sized stand-in in the simulator."""

    tile_id: str
    ticket: TileTicket
    blocks: tuple[str, str]

    @property
    def flops(self) -> int: ...

    @property
    def bundle(self) -> Sized: ...

    @property
    def half(self) -> bool: ...

    def block_bytes(self) -> tuple[int, int]: ...

    def task_frame(self, refs: frozenset[str], key: Ed25519PrivateKey) -> Sized: ...


# ---- effects ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """A frame for one worker: a task (``frame``, already signed) or a control message
    (``message``, encoded when it is written, so the simulator never encodes one)."""

    worker_id: str
    frame: Any = None  # a task frame: bytes on the server, a sized stand-in in the simulator
    tile_id: str = ""  # set on task frames: a closing connection may skip them
    message: Message | None = None

    @property
    def data(self) -> Any:
        return self.frame if self.message is None else encode_message(self.message)


@dataclass(frozen=True)
class Close:
    """Close this connection after the frames already emitted for it (its last words)."""

    worker_id: str
    code: CloseCode
    reason: str


@dataclass(frozen=True)
class Check:
    """Check a returned tile (Freivalds, off the event loop), then call ``checked``."""

    worker_id: str
    tile_id: str
    job: Any  # the Tile
    c: torch.Tensor | None  # None: the result did not decode, so it fails
    up_bytes: int
    compute_s: float


@dataclass(frozen=True)
class Deliver:
    """Place a verified tile into its GEMM; then call ``delivered``."""

    job: Any
    c: Any  # the verified product (the simulator has none)


@dataclass
class Effects:
    sends: list[Send] = field(default_factory=list)
    closes: list[Close] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    delivers: list[Deliver] = field(default_factory=list)
    # Tiles no connected worker may take: compute them here, then call ``delivered``.
    compute_here: list[Any] = field(default_factory=list)
    workers_changed: bool = False  # joins, leaves, pauses: wake whoever waits for workers

    def send(self, worker_id: str, message: Message) -> None:
        self.sends.append(Send(worker_id, message=message))

    def close(self, worker_id: str, code: CloseCode, reason: str) -> None:
        self.closes.append(Close(worker_id, code, reason))


# ---- state -------------------------------------------------------------------------------


@dataclass
class Worker:
    """One connected worker, as the core knows it."""

    worker_id: str  # this connection
    key: str  # the worker's proven public key (hex): its identity in the ledger
    name: str
    profile: DeviceProfile
    window: int
    connected_at: float
    state: WorkerState = WorkerState.WORKING
    reason: str = ""
    last_seen: float = 0.0
    tiles_session: int = 0
    refused: int = 0
    # When each in-flight tile was sent: a worker's claimed compute time is credited
    # no higher than the time it actually held the tile.
    sent_at: dict[str, float] = field(default_factory=dict)
    verifying: set[str] = field(default_factory=set)  # results being checked right now
    messages: TokenBucket | None = None  # this connection's message-rate allowance
    # Tiles sent while the worker held nothing: their round trip is all transfer and
    # compute, no waiting behind another tile, so they measure the links.
    sent_idle: set[str] = field(default_factory=set)
    estimate: DeviceEstimate | None = None  # speed and links, learnt from its tiles
    # The worker's operand cache, mirrored: block id -> bytes, least recently used first,
    # kept in the same order and budget as the worker keeps it (client_app.session).
    blocks: BlockCache[int] = field(default_factory=lambda: BlockCache(0, int))
    sent_bytes: dict[str, int] = field(default_factory=dict)  # tile id -> bytes it cost
    # When its last result arrived: a tile sent while another was computing starts its
    # own compute no earlier (costmodel.queued_start).
    last_result_at: float = 0.0

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)

    @property
    def paused(self) -> bool:
        return self.state == WorkerState.PAUSED


@dataclass
class Counters:
    tiles_sent: int = 0
    tiles_verified: int = 0
    reissued: int = 0  # sends of a tile that had been sent before (lost, refused, failed)
    speculated: int = 0  # copies of tiles predicted late, sent to idle workers
    rejected: int = 0  # results that failed verification
    refused: int = 0  # tiles a worker refused (e.g. bad signature)
    duplicates: int = 0
    not_assigned: int = 0  # results for tiles the sender does not hold (replays, forgeries)
    computed_here: int = 0  # tiles no connected worker could take
    flops_computed_here: int = 0  # their FLOPs: offloaded, yet computed at the coordinator
    kept_here: int = 0  # tiles the planner kept at the coordinator (its own share)
    banned: int = 0  # workers banned in this run
    refused_handshakes: int = 0  # connections that failed to authenticate
    bytes_down: int = 0
    bytes_down_uncached: int = 0  # what bytes_down would be without operand caches
    bytes_up: int = 0
    # Bytes (down and up) of bf16/fp16 tiles: as fp32 they would have been twice as many.
    bytes_half: int = 0


@dataclass(frozen=True)
class PoolView:
    """What the training thread may know about the pool: an immutable snapshot the event
    loop replaces, so the other thread never iterates the loop's live dictionaries."""

    workers: int = 0
    active: int = 0
    memory_cap: int | None = None
    # What the cost model knows of each active worker, for the planner (refreshed on
    # joins and leaves, and every tick after tiles moved an estimate).
    estimates: tuple[DeviceEstimate, ...] = ()


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
        self.jobs: dict[str, Any] = {}  # tile id -> Tile, until it is verified or taken over
        self.pool = PoolView()
        self._estimates_moved = False
        self._ids = itertools.count(1)
        self._now = 0.0

    # ---- queries -----------------------------------------------------------------------

    def active_workers(self) -> int:
        return sum(1 for w in self.workers.values() if not w.paused)

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
        self._refresh_pool()

    # ---- inputs ------------------------------------------------------------------------

    def admit(self, worker_id: str, hello: Hello, now: float) -> Effects:
        """Register a worker whose handshake completed (the Welcome is out)."""
        self._now = now
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
                clock=lambda: self._now,
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
        self._refresh_pool()
        log.info(
            "worker %s joined as %s: %s, %d threads, %.0f GFLOP/s",
            _who(worker),
            worker_id,
            worker.profile.device_name or worker.profile.device,
            worker.profile.threads,
            worker.profile.gflops,
        )
        effects = Effects(workers_changed=True)
        self._dispatch(effects)
        return effects

    def submit(self, jobs: Iterable[Any], now: float) -> Effects:
        """Queue a GEMM's tiles."""
        self._now = now
        jobs = list(jobs)
        for job in jobs:
            self.jobs[job.tile_id] = job
        self.scheduler.submit(job.ticket for job in jobs)
        effects = Effects()
        self._dispatch(effects)
        return effects

    def kept_here(self, gemm_id: str, tiles: int, finished: bool, now: float) -> Effects:
        """The training thread computed ``tiles`` of a GEMM itself; ``finished``: its last
        tile was one of them, so no result will close the GEMM."""
        self._now = now
        self.counters.kept_here += tiles
        effects = Effects()
        if finished:
            self._forget_gemm(gemm_id, effects)
        return effects

    def receive(self, worker_id: str, data: str | bytes | bytearray, now: float) -> Effects:
        """One frame from a connected worker."""
        self._now = now
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
            return self._drop(worker, CloseCode.POLICY, "text frames are not part of the protocol")
        if worker.messages is not None and worker.messages.reserve(1) > 0.0:
            limit = self.config.max_messages_per_s
            effects.send(
                worker_id, Error("rate_limited", f"more than max_messages_per_s={limit:g} messages")
            )
            return self._drop(
                worker, CloseCode.POLICY, f"message rate over max_messages_per_s={limit:g}", effects
            )
        try:
            received = parse_message(data, self.config.limits)
        except (FrameError, LimitExceeded) as exc:
            effects.send(worker_id, Error(exc.code, exc.message))
            return self._drop(worker, CloseCode.POLICY, exc.message, effects)
        except ProtocolError as exc:
            # Well-framed but not understood (unknown type, bad fields): say so, keep going.
            effects.send(worker_id, Error(exc.code, exc.message))
            return effects
        msg = received.message
        if isinstance(msg, Result):
            c: torch.Tensor | None = None
            try:
                c = received.tensors(self.config.limits).get("c")
            except ProtocolError as exc:
                # Counted as a wrong result (it is one), and the sender is told why.
                log.warning("worker %s sent an undecodable result: %s", _who(worker), exc.message)
                effects.send(worker_id, Error(exc.code, exc.message, msg.tile_id))
            self._on_result(worker, msg, c, len(received.frame.payload), effects)
            return effects
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            effects.send(worker_id, Error("unexpected", f"{msg.TYPE} is not sent by workers"))
            return effects
        handler(self, worker, msg, effects)
        return effects

    def handle(self, worker_id: str, msg: Message, now: float) -> Effects:
        """One decoded message from a connected worker, without the frame (the
        simulator's input); a ``Result`` here carries no tensor to check."""
        self._now = now
        effects = Effects()
        worker = self.workers.get(worker_id)
        if worker is None:
            return effects
        worker.last_seen = now
        self.scheduler.heartbeat(worker_id, now)
        if isinstance(msg, Result):
            ticket = self.jobs[msg.tile_id].ticket if msg.tile_id in self.jobs else None
            self._on_result(worker, msg, None, ticket.up_bytes if ticket else 0, effects)
        else:
            _HANDLERS[type(msg)](self, worker, msg, effects)
        return effects

    def checked(self, check: Check, verdict: CheckResult | None, now: float) -> Effects:
        """A result's check finished (``verdict`` None: it did not decode)."""
        self._now = now
        effects = Effects()
        worker = self.workers.get(check.worker_id)
        if worker is None:
            # It left (or was banned) while the check ran: its tiles are already
            # re-issued, and a verdict on it would count twice.
            self.counters.duplicates += 1
            return effects
        worker.verifying.discard(check.tile_id)
        if verdict is None or not verdict.ok:
            self._failed_check(worker, check.tile_id, effects, verdict)
            return effects
        job = check.job
        completion = self.scheduler.complete(worker.worker_id, check.tile_id, now)
        if completion.verdict is not Verdict.ACCEPTED:
            self.counters.duplicates += 1
            return effects
        self.jobs.pop(check.tile_id, None)
        held_s = now - worker.sent_at.pop(check.tile_id, now)
        up = check.up_bytes
        self._learn(worker, job, check.compute_s, held_s, up)
        worker.tiles_session += 1
        self.counters.tiles_verified += 1
        self.counters.bytes_up += up
        if job.half:
            self.counters.bytes_half += up
        before = self.ledger.get(worker.key)
        self.ledger.credit(
            worker.key,
            name=worker.name,
            reputation=after_verified(before.reputation, self.config.reputation),
            flops=job.flops,
            bytes_down=worker.sent_bytes.pop(check.tile_id, len(job.bundle)),
            bytes_up=up,
            compute_s=min(check.compute_s, held_s),
            now=self._wall_time(),
        )
        for other in completion.cancel:
            self._cancel(other, check.tile_id, effects)
        self._dispatch(effects)
        effects.delivers.append(Deliver(job, check.c))
        return effects

    def delivered(self, job: Any, finished: bool, now: float) -> Effects:
        """A tile (verified, or computed here) is in its GEMM; ``finished``: the GEMM is."""
        self._now = now
        effects = Effects()
        if finished:
            self._forget_gemm(job.ticket.gemm_id, effects)
        return effects

    def disconnected(self, worker_id: str, now: float) -> Effects:
        """The connection is gone (closed by either side): its tiles move on."""
        self._now = now
        effects = Effects()
        worker = self.workers.get(worker_id)
        if worker is not None:
            self._forget(worker, effects)
        return effects

    def tick(self, now: float) -> Effects:
        """The expiry timer: drop workers that missed their heartbeats, re-issue lost
        tiles, copy late ones, compute stranded ones here."""
        self._now = now
        effects = Effects()
        expiry = self.scheduler.expire(now)
        for worker_id in expiry.dead_workers:
            worker = self.workers.get(worker_id)
            if worker is not None:
                log.warning("worker %s missed its heartbeats: dropping it", worker.name)
                effects.close(worker_id, CloseCode.TIMEOUT, "heartbeat timeout")
                self._forget(worker, effects)
        if expiry.requeued:
            self._dispatch(effects)
        self._speculate(effects)
        self._rescue_stranded(effects)
        if self._estimates_moved:
            self._refresh_pool()
        return effects

    # ---- message handlers (one per type a worker sends) ----------------------------------

    def _on_result(
        self, worker: Worker, msg: Result, c: torch.Tensor | None, up_bytes: int, effects: Effects
    ) -> None:
        if msg.tile_id in worker.verifying:
            self.counters.duplicates += 1  # the same result again: one check is enough
            return
        worker.last_result_at = self._now
        job = self.jobs.get(msg.tile_id)
        if job is None:
            # Done already (a slower copy, or a result after a cancel): nothing to do.
            self.counters.duplicates += 1
            return
        if msg.tile_id not in self.scheduler.in_flight(worker.worker_id):
            self.counters.not_assigned += 1
            effects.send(
                worker.worker_id,
                Error("not_assigned", "result for a tile not assigned to you", msg.tile_id),
            )
            return
        # Checked off the event loop, so this connection's next frames (heartbeats among
        # them) are read while the check runs.
        worker.verifying.add(msg.tile_id)
        effects.checks.append(
            Check(worker.worker_id, msg.tile_id, job, c, up_bytes, max(0.0, msg.compute_s))
        )

    def _on_heartbeat(self, worker: Worker, msg: Heartbeat, effects: Effects) -> None:
        worker.state, worker.reason = WorkerState(msg.state), msg.reason
        credit = self.ledger.get(worker.key)
        effects.send(worker.worker_id, Ack(msg.seq, credit.tiles, round(credit.gflop, 6)))

    def _on_pause(self, worker: Worker, msg: Pause, effects: Effects) -> None:
        worker.state, worker.reason = WorkerState.PAUSED, msg.reason
        requeued = self.scheduler.set_paused(worker.worker_id, True, self._now)
        self._refresh_pool()
        log.info(
            "worker %s paused (%s); %d tiles move elsewhere", worker.name, msg.reason, len(requeued)
        )
        effects.workers_changed = True
        self._dispatch(effects)

    def _on_resume(self, worker: Worker, msg: Resume, effects: Effects) -> None:
        worker.state, worker.reason = WorkerState.WORKING, ""
        self.scheduler.set_paused(worker.worker_id, False, self._now)
        self._refresh_pool()
        effects.workers_changed = True
        self._dispatch(effects)

    def _on_bye(self, worker: Worker, msg: Bye, effects: Effects) -> None:
        log.info("worker %s is leaving: %s", worker.name, msg.reason or "no reason given")
        self._drop(worker, CloseCode.NORMAL, "bye", effects)

    def _on_error(self, worker: Worker, msg: Error, effects: Effects) -> None:
        held = msg.tile_id in self.scheduler.in_flight(worker.worker_id)
        job = self.jobs.get(msg.tile_id)
        if msg.code == "missing_block" and job is not None and held:
            # Its cache and our mirror of it disagree (it dropped the tile that would
            # have cached a block, say). It emptied its cache; so do we, and resend whole.
            log.info("worker %s lacks an operand block of %s: resending", _who(worker), msg.tile_id)
            worker.blocks.clear()
            frame = self._frame_for(worker, job)
            effects.sends.append(Send(worker.worker_id, frame, job.tile_id))
            worker.sent_bytes[job.tile_id] = worker.sent_bytes.get(job.tile_id, 0) + len(frame)
            self.counters.bytes_down += len(frame)
            return
        if msg.tile_id and held:
            worker.refused += 1
            self.counters.refused += 1
            log.warning(
                "worker %s refused tile %s: %s: %s", worker.name, msg.tile_id, msg.code, msg.message
            )
            worker.sent_at.pop(msg.tile_id, None)
            self.scheduler.reject(
                worker.worker_id, msg.tile_id, self._now, reason=f"refused: {msg.code}"
            )
            self._dispatch(effects)
            self._rescue_stranded(effects)
        else:
            log.warning("worker %s reported %s: %s", worker.name, msg.code, msg.message)

    # ---- decisions -----------------------------------------------------------------------

    def _drop(
        self, worker: Worker, code: CloseCode, reason: str, effects: Effects | None = None
    ) -> Effects:
        """Close this one connection with a reason; its tiles move on now, not when the
        close handshake ends (that can take a while behind a flooded receive buffer)."""
        effects = effects if effects is not None else Effects()
        if code != CloseCode.NORMAL:
            log.warning("closing %s (%s): %s", worker.worker_id, _who(worker), reason)
        effects.close(worker.worker_id, code, reason)
        self._forget(worker, effects)
        return effects

    def _forget(self, worker: Worker, effects: Effects) -> None:
        if self.workers.pop(worker.worker_id, None) is None:
            return
        self._refresh_pool()
        if worker.worker_id in self.scheduler.workers():
            requeued = self.scheduler.remove_worker(worker.worker_id, self._now)
            if requeued:
                log.info(
                    "worker %s left with %d tiles in flight: re-queued", worker.name, len(requeued)
                )
        effects.workers_changed = True
        self._dispatch(effects)
        self._rescue_stranded(effects)

    def _refresh_pool(self) -> None:
        """Publish a new ``PoolView`` (on joins, leaves, pauses, and moved estimates)."""
        caps = [
            w.profile.mem_cap_bytes
            for w in self.workers.values()
            if w.profile.mem_cap_bytes >= MIN_PLANNING_MEMORY_CAP
        ]
        self._estimates_moved = False
        self.pool = PoolView(
            workers=len(self.workers),
            active=self.active_workers(),
            estimates=tuple(
                w.estimate for w in self.workers.values() if w.estimate is not None and not w.paused
            ),
            # The smallest cap, so any worker can take any tile. Caps below a floor are
            # left out: one volunteer must not shred every GEMM into crumbs; the
            # scheduler gives that worker no tile over its cap, and tiles nobody can
            # take are computed here.
            memory_cap=min(caps) if caps else None,
        )

    def _dispatch(self, effects: Effects) -> None:
        # Steals of planned tiles and earliest-finish holds (leave_for_faster) cost a
        # prediction per worker per call: past a few hundred workers, the planned workers
        # first, then the pull order, decide.
        predict = len(self.workers) <= MAX_PREDICTED_WORKERS
        for assignment in self.scheduler.assign(
            self._now,
            prefers=self._holds_a_block,
            finish_at=self.predicted_finish if predict else None,
            run_time=self._run_time if predict else None,
            busy_time=self._busy_time if predict else None,
        ):
            self._send(assignment, effects)

    def _holds_a_block(self, worker_id: str, ticket: TileTicket) -> bool:
        """Whether the worker's operand cache already holds one of the tile's operands:
        then it should get the tile, and the coordinator sends one operand, not two."""
        worker = self.workers.get(worker_id)
        return worker is not None and any(block in worker.blocks for block in ticket.blocks)

    def _send(self, assignment: Assignment, effects: Effects) -> None:
        worker = self.workers.get(assignment.worker_id)
        job = self.jobs.get(assignment.tile_id)
        if worker is None or job is None:  # pragma: no cover - scheduler and maps agree
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
        if not any(t in worker.sent_at for t in held if t != job.tile_id):
            # Nothing sent ahead of it (tiles assigned with it go out after it): its
            # round trip is transfer and compute alone.
            worker.sent_idle.add(job.tile_id)
        frame = self._frame_for(worker, job)
        effects.sends.append(Send(worker.worker_id, frame, job.tile_id))
        worker.sent_at[job.tile_id] = self._now
        worker.sent_bytes[job.tile_id] = len(frame)
        self.counters.tiles_sent += 1
        self.counters.reissued += assignment.reissue
        self.counters.bytes_down += len(frame)
        self.counters.bytes_down_uncached += len(job.bundle)
        if job.half:
            self.counters.bytes_half += len(frame)

    def _frame_for(self, worker: Worker, job: Any) -> Sized:
        """The task frame for this worker: the shared bundle, or (for a worker with an
        operand cache) one that refers to the operand blocks it already holds.

        Updates the mirror of the worker's cache exactly as the worker will update the
        cache itself: operands sent inline first, then the ones referred to, each moved
        to the most recently used end; then the least recently used go past the budget.
        """
        if worker.blocks.budget <= 0:
            return job.bundle
        ids = dict(zip(("a", "b"), job.blocks, strict=True))
        sizes = dict(zip(("a", "b"), job.block_bytes(), strict=True))
        refs = frozenset(name for name in ("a", "b") if ids[name] in worker.blocks)
        order = [n for n in ("a", "b") if n not in refs] + sorted(refs)  # the task's order
        worker.blocks.record((ids[name], sizes[name]) for name in order)
        return job.task_frame(refs, self.key)

    def _speculate(self, effects: Effects) -> None:
        """Copy tiles predicted late (a slow or withholding worker) to idle workers; the
        first verified result wins and the other holder is cancelled."""
        for copy in self.scheduler.speculate(self._now, self.predicted_finish, self._run_time):
            log.info("tile %s looks late: a copy goes to %s", copy.tile_id, copy.worker_id)
            self.counters.speculated += 1
            self._send(copy, effects)

    def _run_time(self, worker_id: str, ticket: TileTicket) -> float:
        """Seconds from sending ``ticket`` to an idle ``worker_id`` until its result."""
        worker = self.workers.get(worker_id)
        if worker is None or worker.estimate is None:
            return float("inf")
        return worker.estimate.tile_seconds(ticket.flops, ticket.down_bytes, ticket.up_bytes)

    def _busy_time(self, worker_id: str, ticket: TileTicket) -> float:
        """Seconds ``ticket`` adds behind a worker's other tiles (its prefetch window
        overlaps transfers with compute)."""
        worker = self.workers.get(worker_id)
        if worker is None or worker.estimate is None:
            return float("inf")
        if worker.window < 2:
            return self._run_time(worker_id, ticket)
        return worker.estimate.pipelined_seconds(ticket.flops, ticket.down_bytes, ticket.up_bytes)

    def predicted_finish(self, worker_id: str, tile_id: str) -> float:
        """When ``worker_id`` will return ``tile_id``: after the tiles sent to it before
        this one (it computes one at a time), later once it is overdue."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return float("inf")
        # A tile the scheduler handed out in the assign call asking is sent right after.
        sent = worker.sent_at.get(tile_id, self._now)
        expected = 0.0
        for held in self.scheduler.in_flight(worker_id):
            job = self.jobs.get(held)
            if job is not None and worker.sent_at.get(held, self._now) <= sent:
                expected += self._run_time(worker_id, job.ticket)
        return overdue_finish(queued_start(sent, worker.last_result_at), expected, self._now)

    def _learn(self, worker: Worker, job: Any, claimed_s: float, held_s: float, up: int) -> None:
        """Move the worker's estimate toward what this tile showed. Its claimed compute
        time counts no higher than the time it held the tile; the rest of the round trip
        measures the links only if the tile did not wait behind another one."""
        if worker.estimate is None:
            return
        compute_s = max(0.0, min(claimed_s, held_s))
        transfer_s: float | None = None
        if job.tile_id in worker.sent_idle:
            transfer_s = held_s - compute_s
        worker.sent_idle.discard(job.tile_id)
        down = worker.sent_bytes.get(job.tile_id, len(job.bundle))  # what went over the link
        share = down / (down + up) if down + up else 0.0
        worker.estimate = observe(
            worker.estimate,
            TileObservation(
                flops=job.flops,
                down_bytes=down,
                up_bytes=up,
                down_s=transfer_s * share if transfer_s else None,
                compute_s=compute_s,
                up_s=transfer_s * (1 - share) if transfer_s else None,
            ),
            self._now,
        )
        self._estimates_moved = True

    def _failed_check(
        self, worker: Worker, tile_id: str, effects: Effects, check: CheckResult | None
    ) -> None:
        """A wrong result: discard it, re-issue the tile, cut the worker's reputation, and
        ban its key (closing all its connections) once the reputation falls too low."""
        self.counters.rejected += 1
        policy = self.config.reputation
        before = self.ledger.get(worker.key)
        reputation = after_failed(before.reputation, policy)
        banned = ""
        if not before.banned_reason and is_banned(reputation, policy):
            banned = ban_reason(before.rejected + 1, reputation)
        self.ledger.reject(
            worker.key,
            name=worker.name,
            reputation=reputation,
            banned_reason=banned,
            now=self._wall_time(),
        )
        log.warning(
            "tile %s from %s failed verification (%s; reputation %.2f): re-issuing",
            tile_id,
            _who(worker),
            _why(check),
            reputation,
        )
        worker.sent_at.pop(tile_id, None)
        self.scheduler.reject(worker.worker_id, tile_id, self._now, reason="failed verification")
        # Tell the worker: an honest volunteer with faulty hardware should learn of it.
        verdict = Error(
            "failed_check",
            f"the result failed verification and was discarded; reputation now {reputation:.2f}",
            tile_id,
        )
        effects.send(worker.worker_id, verdict)
        if banned:
            self.counters.banned += 1
            log.warning("banning worker %s: %s", _who(worker), banned)
            for other in [w for w in self.workers.values() if w.key == worker.key]:
                effects.send(other.worker_id, Error("banned", f"banned: {banned}"))
                self._drop(other, CloseCode.POLICY, f"banned: {banned}", effects)
        self._dispatch(effects)
        self._rescue_stranded(effects)

    def _forget_gemm(self, gemm_id: str, effects: Effects) -> None:
        # Keeps the scheduler's record of done tiles bounded by the GEMMs in flight.
        for worker_id, tile_id in self.scheduler.forget_gemm(gemm_id):
            self._cancel(worker_id, tile_id, effects)

    def _rescue_stranded(self, effects: Effects) -> None:
        """Compute here the tiles that no connected worker may take (all refused them,
        or they exceed every memory cap): waiting for them would wait forever."""
        for tile_id in self.scheduler.stranded():
            for worker_id in self.scheduler.take_over(tile_id):
                self._cancel(worker_id, tile_id, effects)
            job = self.jobs.pop(tile_id, None)
            if job is None:  # pragma: no cover - the scheduler and the job map agree
                continue
            self.counters.computed_here += 1
            self.counters.flops_computed_here += job.flops
            log.warning(
                "no connected worker may take tile %s (refused by all, or over every memory "
                "cap): computing it at the coordinator",
                tile_id,
            )
            effects.compute_here.append(job)

    def _cancel(self, worker_id: str, tile_id: str, effects: Effects) -> None:
        if worker_id in self.workers:
            effects.send(worker_id, Cancel(tile_id))

    def _wall_time(self) -> float:
        return self._wall_clock() if self._wall_clock is not None else self._now

    # ---- status --------------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        workers = []
        for worker in self.workers.values():
            standing = self.ledger.get(worker.key)
            workers.append(
                {
                    "id": worker.worker_id,
                    "key": worker.fingerprint,
                    "name": worker.name,
                    "state": worker.state.value,
                    "reason": worker.reason,
                    "device": worker.profile.device_name or worker.profile.device,
                    "threads": worker.profile.threads,
                    "gflops": worker.profile.gflops,
                    # What its tiles show, which may differ from what it measured at start.
                    "gflops_observed": round(worker.estimate.flops_per_s / 1e9, 2)
                    if worker.estimate is not None
                    else 0.0,
                    "connected_s": round(now - worker.connected_at, 1),
                    "last_seen_s": round(now - worker.last_seen, 1),
                    "in_flight": len(self.scheduler.in_flight(worker.worker_id)),
                    "tiles_session": worker.tiles_session,
                    "refused": worker.refused,
                    "reputation": round(standing.reputation, 4),
                    "contribution": standing.to_json(),
                }
            )
        counters = self.counters
        return {
            "coordinator_key": fingerprint(self.key),
            "workers": workers,
            "ledger": {c.key_fingerprint: c.to_json() for c in self.ledger.all()},
            "banned": [
                {"key": c.key_fingerprint, "name": c.name, "reason": c.banned_reason}
                for c in self.ledger.banned()
            ],
            "tiles": {
                "sent": counters.tiles_sent,
                "verified": counters.tiles_verified,
                "reissued": counters.reissued,
                "speculated": counters.speculated,
                "rejected": counters.rejected,
                "refused": counters.refused,
                "duplicates": counters.duplicates,
                "not_assigned": counters.not_assigned,
                "computed_here": counters.computed_here,
                "kept_here": counters.kept_here,
                "queued": self.scheduler.queued_count(),
                "pending": self.scheduler.pending(),
            },
            "traffic": {
                "bytes_down": counters.bytes_down,
                "bytes_down_uncached": counters.bytes_down_uncached,
                "bytes_up": counters.bytes_up,
                "bytes_half": counters.bytes_half,
            },
        }


_HANDLERS: dict[type, Callable[[CoordinatorCore, Worker, Any, Effects], None]] = {
    Heartbeat: CoordinatorCore._on_heartbeat,
    Error: CoordinatorCore._on_error,
    Pause: CoordinatorCore._on_pause,
    Resume: CoordinatorCore._on_resume,
    Bye: CoordinatorCore._on_bye,
}


def _why(check: CheckResult | None) -> str:
    if check is None:
        return "undecodable"
    if check.reason == "mismatch":
        return f"{check.margin:.3g}x its rounding threshold"
    return check.reason


def _who(worker: Worker) -> str:
    """A worker in logs: its chosen name and the key that makes it who it is."""
    return f"{worker.name} [{worker.fingerprint[:9]}]"
