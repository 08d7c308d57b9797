"""The coordinator's network side: one asyncio process, WebSockets for workers, HTTP status.

Everything here runs on the event loop thread and stays cheap: tiles arrive already
encoded and signed from the training thread, results are checked (Freivalds) and placed
on a separate thread, so heartbeats are answered while the coordinator computes.
The pure ``Scheduler`` decides who gets which tile; this module only moves bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from common.auth import check_hello, make_welcome, new_nonce
from common.block_cache import BlockCache
from common.errors import FrameError, LimitExceeded, ProtocolError
from common.limits import DEFAULT_LIMITS, WireLimits
from common.messages import (
    Ack,
    Bye,
    Cancel,
    Challenge,
    DeviceProfile,
    Error,
    Heartbeat,
    Hello,
    Message,
    Pause,
    Received,
    Result,
    Resume,
    encode_message,
    encode_task,
    parse_message,
)
from common.signing import fingerprint, public_key_hex
from common.token_bucket import TokenBucket
from coordinator import http_api
from coordinator.costmodel import (
    DeviceEstimate,
    TileObservation,
    from_profile,
    observe,
    overdue_finish,
    queued_start,
)
from coordinator.ledger import Ledger
from coordinator.reputation import (
    ReputationPolicy,
    after_failed,
    after_verified,
    ban_reason,
    is_banned,
)
from coordinator.scheduler import Assignment, Scheduler, SchedulerConfig, TileTicket, Verdict
from coordinator.tiling import TileJob
from coordinator.verify import CheckCache, CheckResult, check_product, new_generator

log = logging.getLogger("cleave.coordinator")

WS_PATH = "/ws"
MIN_PLANNING_MEMORY_CAP = 16 << 20
CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008  # RFC 6455: policy violation (malformed or forbidden messages)
CLOSE_TRY_LATER = 1013  # RFC 6455: try again later (too many handshakes at once)
CLOSE_TIMEOUT = 4000  # application code: missed heartbeats
# A link speed to start from until a worker's first tiles measure its own: a modest
# home connection, so early estimates err on the slow side.
LINK_GUESS_BYTES_PER_S = 10e6
MAX_PREDICTED_WORKERS = 256


@dataclass(frozen=True)
class ServerConfig:
    heartbeat_interval_s: float = 2.0
    handshake_timeout_s: float = 10.0
    join_token: str = ""  # non-empty: a private pool; workers must prove they know it
    # Connections still authenticating at once: beyond this, new ones are told to come
    # back later, so a flood of idle sockets cannot tie up the coordinator.
    max_handshakes: int = 256
    # Messages per second from one worker, with a burst allowance. A worker sends a
    # heartbeat every few seconds and one result per tile; hundreds a second is abuse.
    max_messages_per_s: float = 200.0
    message_burst: int = 400
    reputation: ReputationPolicy = field(default_factory=ReputationPolicy)
    expire_every_s: float = 0.5
    max_message_bytes: int = 256 << 20  # largest result frame accepted from a worker
    limits: WireLimits = DEFAULT_LIMITS
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass
class WorkerConn:
    worker_id: str  # this connection
    key: str  # the worker's proven public key (hex): its identity in the ledger
    name: str
    ws: ServerConnection
    profile: DeviceProfile
    window: int
    connected_at: float
    outbox: asyncio.Queue[bytes | bytearray] = field(default_factory=asyncio.Queue)
    state: str = "working"
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
    # joins and leaves, and every expire tick after tiles moved an estimate).
    estimates: tuple[DeviceEstimate, ...] = ()


class _Drop(Exception):
    """Close this one connection with a reason; the server and the run carry on."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class CoordinatorServer:
    def __init__(
        self,
        *,
        key: Ed25519PrivateKey,
        job_name: str,
        ledger: Ledger,
        config: ServerConfig = ServerConfig(),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        status_extra: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.key = key
        self.job_name = job_name
        self.ledger = ledger
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.status_extra = status_extra
        self.scheduler = Scheduler(config.scheduler)
        self.counters = Counters()
        self.conns: dict[str, WorkerConn] = {}
        self.jobs: dict[str, TileJob] = {}
        self.pool = PoolView()
        self._estimates_moved = False
        self.port = 0
        self._ids = itertools.count(1)
        # One verify thread, so one private generator needs no lock.
        self._verify_pool = ThreadPoolExecutor(1, thread_name_prefix="cleave-verify")
        self._check_vectors = new_generator()
        # Row norms and b ρ of operand blocks, shared by the tiles a block is part of.
        self._check_cache = CheckCache()
        self._server: Server | None = None
        self._handshaking = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._workers_changed = asyncio.Condition()

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port``; with ``ssl_context``, WebSocket and status are TLS only."""
        self._server = await serve(
            self._handle,
            host,
            port,
            ssl=ssl_context,
            compression=None,  # deflate on float data costs ~25x throughput
            max_size=self.config.max_message_bytes,
            process_request=self._process_request,
            ping_interval=20,
            ping_timeout=20,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._spawn(self._expire_loop())
        log.info("coordinator key fingerprint %s", fingerprint(self.key))
        return self.port

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        self._verify_pool.shutdown(wait=False, cancel_futures=True)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # A background task must never die silently: say what broke.
            log.error("background task %s failed", task.get_coro(), exc_info=task.exception())

    async def wait_for_workers(self, count: int) -> None:
        async with self._workers_changed:
            await self._workers_changed.wait_for(lambda: self.pool.active >= count)

    def active_workers(self) -> int:
        return sum(1 for c in self.conns.values() if c.state != "paused")

    def _refresh_pool(self) -> None:
        """Publish a new ``PoolView`` (event loop thread only; on joins, leaves, pauses)."""
        caps = [
            c.profile.mem_cap_bytes
            for c in self.conns.values()
            if c.profile.mem_cap_bytes >= MIN_PLANNING_MEMORY_CAP
        ]
        self._estimates_moved = False
        self.pool = PoolView(
            workers=len(self.conns),
            active=self.active_workers(),
            estimates=tuple(
                c.estimate
                for c in self.conns.values()
                if c.estimate is not None and c.state != "paused"
            ),
            # The smallest cap, so any worker can take any tile. Caps below a floor are
            # left out: one volunteer must not shred every GEMM into crumbs; the
            # scheduler gives that worker no tile over its cap, and tiles nobody can
            # take are computed here.
            memory_cap=min(caps) if caps else None,
        )

    # ---- work in -----------------------------------------------------------------------

    def submit(self, jobs: list[TileJob]) -> None:
        """Queue a GEMM's tiles (event loop thread only)."""
        for job in jobs:
            self.jobs[job.tile_id] = job
        self.scheduler.submit(job.ticket for job in jobs)
        self._dispatch()

    def _dispatch(self) -> None:
        # Steals of planned tiles and earliest-finish holds (leave_for_faster) cost a
        # prediction per worker per call: past a few hundred workers, the planned workers
        # first, then the pull order, decide.
        predict = len(self.conns) <= MAX_PREDICTED_WORKERS
        for assignment in self.scheduler.assign(
            self.clock(),
            prefers=self._holds_a_block,
            finish_at=self._predicted_finish if predict else None,
            run_time=self._run_time if predict else None,
            busy_time=self._busy_time if predict else None,
        ):
            self._send(assignment)

    def _holds_a_block(self, worker_id: str, ticket: TileTicket) -> bool:
        """Whether the worker's operand cache already holds one of the tile's operands:
        then it should get the tile, and the coordinator sends one operand, not two."""
        conn = self.conns.get(worker_id)
        return conn is not None and any(block in conn.blocks for block in ticket.blocks)

    def _send(self, assignment: Assignment) -> None:
        conn = self.conns.get(assignment.worker_id)
        job = self.jobs.get(assignment.tile_id)
        if conn is None or job is None:  # pragma: no cover - scheduler and maps agree
            log.error(
                "scheduler assigned %s to %s, which is unknown",
                assignment.tile_id,
                assignment.worker_id,
            )
            return
        held = self.scheduler.in_flight(conn.worker_id)
        if len(conn.sent_at) > 4 * conn.window + 8:
            # Tiles cancelled or moved elsewhere leave their send times behind: keep
            # only those of tiles the worker still holds, so a long session stays small.
            conn.sent_at = {t: at for t, at in conn.sent_at.items() if t in held}
            conn.sent_bytes = {t: n for t, n in conn.sent_bytes.items() if t in held}
            conn.sent_idle &= held
        if len(held) == 1:  # only this tile: nothing for it to wait behind
            conn.sent_idle.add(job.tile_id)
        frame = self._frame_for(conn, job)
        conn.outbox.put_nowait(frame)
        conn.sent_at[job.tile_id] = self.clock()
        conn.sent_bytes[job.tile_id] = len(frame)
        self.counters.tiles_sent += 1
        self.counters.reissued += assignment.reissue
        self.counters.bytes_down += len(frame)
        self.counters.bytes_down_uncached += len(job.bundle)
        if job.a.element_size() == 2:
            self.counters.bytes_half += len(frame)

    def _frame_for(self, conn: WorkerConn, job: TileJob) -> bytes | bytearray:
        """The task frame for this worker: the shared bundle, or (for a worker with an
        operand cache) one that refers to the operand blocks it already holds.

        Updates the mirror of the worker's cache exactly as the worker will update the
        cache itself: operands sent inline first, then the ones referred to, each moved
        to the most recently used end; then the least recently used go past the budget.
        """
        if conn.blocks.budget <= 0:
            return job.bundle
        operands = {"a": job.a, "b": job.b}
        ids = dict(zip(("a", "b"), job.blocks, strict=True))
        refs = frozenset(name for name in ("a", "b") if ids[name] in conn.blocks)
        order = [n for n in ("a", "b") if n not in refs] + sorted(refs)  # the task's order
        conn.blocks.record((ids[name], operands[name].nbytes) for name in order)
        return encode_task(
            job.tile_id,
            job.gemm.op,
            job.a,
            job.b,
            self.key,
            blocks=job.blocks,
            refs=refs,
            unfold=job.unfold,
        )

    def _speculate(self) -> None:
        """Copy tiles predicted late (a slow or withholding worker) to idle workers; the
        first verified result wins and the other holder is cancelled."""
        copies = self.scheduler.speculate(self.clock(), self._predicted_finish, self._run_time)
        for copy in copies:
            log.info("tile %s looks late: a copy goes to %s", copy.tile_id, copy.worker_id)
            self.counters.speculated += 1
            self._send(copy)

    def _run_time(self, worker_id: str, ticket: TileTicket) -> float:
        """Seconds from sending ``ticket`` to an idle ``worker_id`` until its result."""
        conn = self.conns.get(worker_id)
        if conn is None or conn.estimate is None:
            return float("inf")
        return conn.estimate.tile_seconds(ticket.flops, ticket.down_bytes, ticket.up_bytes)

    def _busy_time(self, worker_id: str, ticket: TileTicket) -> float:
        """Seconds ``ticket`` adds behind a worker's other tiles (its prefetch window
        overlaps transfers with compute)."""
        conn = self.conns.get(worker_id)
        if conn is None or conn.estimate is None:
            return float("inf")
        if conn.window < 2:
            return self._run_time(worker_id, ticket)
        return conn.estimate.pipelined_seconds(ticket.flops, ticket.down_bytes, ticket.up_bytes)

    def _predicted_finish(self, worker_id: str, tile_id: str) -> float:
        """When ``worker_id`` will return ``tile_id``: after the tiles sent to it before
        this one (it computes one at a time), later once it is overdue."""
        conn = self.conns.get(worker_id)
        sent = conn.sent_at.get(tile_id) if conn is not None else None
        if conn is None or sent is None:
            return float("inf")
        expected = 0.0
        for held in self.scheduler.in_flight(worker_id):
            job = self.jobs.get(held)
            if job is not None and conn.sent_at.get(held, sent) <= sent:
                expected += self._run_time(worker_id, job.ticket)
        return overdue_finish(queued_start(sent, conn.last_result_at), expected, self.clock())

    # ---- connections -----------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        if self._handshaking >= self.config.max_handshakes:
            await _close(ws, CLOSE_TRY_LATER, "too many connections are joining; retry later")
            return
        self._handshaking += 1
        try:
            conn = await asyncio.wait_for(self._handshake(ws), self.config.handshake_timeout_s)
        except asyncio.TimeoutError:
            self.counters.refused_handshakes += 1
            await _close(ws, CLOSE_POLICY, "no valid hello within the handshake timeout")
            return
        except _Drop as drop:
            self.counters.refused_handshakes += 1
            log.info("refused a connection from %s: %s", _peer(ws), drop.reason)
            await _close(ws, drop.code, drop.reason)
            return
        except ConnectionClosed:
            return
        finally:
            self._handshaking -= 1
        # Registered only now, after the Welcome went out: a client that vanishes during
        # the handshake never becomes a ghost that tiles are queued for.
        self._register(conn)
        writer = self._spawn(self._writer(conn))
        try:
            await self._notify_workers_changed()
            self._dispatch()
            async for data in ws:
                await self._on_frame(conn, data)
        except _Drop as drop:
            if drop.code != CLOSE_NORMAL:
                log.warning("closing %s (%s): %s", conn.worker_id, _who(conn), drop.reason)
            # Its tiles move on now: the close handshake can take a while behind a
            # flooded receive buffer.
            await self._forget(conn)
            await _close(ws, drop.code, drop.reason)
        except ConnectionClosed:
            pass
        finally:
            writer.cancel()
            await self._forget(conn)

    async def _handshake(self, ws: ServerConnection) -> WorkerConn:
        """Challenge out, signed Hello in, signed Welcome out (``common.auth``).

        Registers nothing: see ``_register``.
        """
        if ws.request is not None and ws.request.path != WS_PATH:
            raise _Drop(CLOSE_POLICY, f"workers connect to {WS_PATH}")
        challenge = Challenge(
            nonce=new_nonce(),
            coordinator_key=public_key_hex(self.key),
            token_required=bool(self.config.join_token),
        )
        await ws.send(encode_message(challenge))
        data = await ws.recv()
        if isinstance(data, str):
            raise _Drop(CLOSE_POLICY, "text frames are not part of the protocol")
        try:
            received = parse_message(data, self.config.limits)
            hello = received.message
            if not isinstance(hello, Hello):
                raise ProtocolError(
                    f"expected a hello, got a {received.frame.type!r} message",
                    code="unexpected_message",
                )
            check_hello(hello, received.frame.header, challenge, self.config.join_token)
        except ProtocolError as exc:
            await ws.send(encode_message(Error(exc.code, exc.message)))
            raise _Drop(CLOSE_POLICY, f"bad hello: {exc.message}") from None
        standing = self.ledger.get(hello.worker_key)
        if standing.banned_reason:
            message = f"worker {fingerprint(hello.worker_key)} is banned: {standing.banned_reason}"
            await ws.send(encode_message(Error("banned", message)))
            raise _Drop(CLOSE_POLICY, message)
        worker_id = f"w{next(self._ids)}"
        welcome = make_welcome(
            self.key,
            hello,
            worker_id=worker_id,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            max_frame_bytes=self.config.max_message_bytes,
            job=self.job_name,
        )
        await ws.send(encode_message(welcome))
        now = self.clock()
        estimate = from_profile(
            worker_id,
            hello.profile,
            down_bps=LINK_GUESS_BYTES_PER_S,
            up_bps=LINK_GUESS_BYTES_PER_S,
            now=now,
        )
        return WorkerConn(
            worker_id,
            hello.worker_key,
            hello.name,
            ws,
            hello.profile,
            hello.window,
            now,
            last_seen=now,
            messages=TokenBucket(
                self.config.max_messages_per_s, self.config.message_burst, clock=self.clock
            ),
            estimate=estimate,
            blocks=BlockCache(hello.cache_bytes, int),
        )

    def _register(self, conn: WorkerConn) -> None:
        self.conns[conn.worker_id] = conn
        self.scheduler.add_worker(
            conn.worker_id,
            window=conn.window,
            now=conn.connected_at,
            mem_cap_bytes=conn.profile.mem_cap_bytes or None,
        )
        self._refresh_pool()
        log.info(
            "worker %s joined as %s: %s, %d threads, %.0f GFLOP/s",
            _who(conn),
            conn.worker_id,
            conn.profile.device_name or conn.profile.device,
            conn.profile.threads,
            conn.profile.gflops,
        )

    async def _writer(self, conn: WorkerConn) -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                await conn.ws.send(await conn.outbox.get())

    async def _forget(self, conn: WorkerConn) -> None:
        if self.conns.pop(conn.worker_id, None) is None:
            return
        self._refresh_pool()
        if conn.worker_id in self.scheduler.workers():
            requeued = self.scheduler.remove_worker(conn.worker_id, self.clock())
            if requeued:
                log.info(
                    "worker %s left with %d tiles in flight: re-queued", conn.name, len(requeued)
                )
        await self._notify_workers_changed()
        self._dispatch()
        self._rescue_stranded()

    async def _notify_workers_changed(self) -> None:
        async with self._workers_changed:
            self._workers_changed.notify_all()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.expire_every_s)
            expiry = self.scheduler.expire(self.clock())
            for worker_id in expiry.dead_workers:
                conn = self.conns.get(worker_id)
                if conn is not None:
                    log.warning("worker %s missed its heartbeats: dropping it", conn.name)
                    self._spawn(_close(conn.ws, CLOSE_TIMEOUT, "heartbeat timeout"))
                    await self._forget(conn)
            if expiry.requeued:
                self._dispatch()
            self._speculate()
            self._rescue_stranded()
            if self._estimates_moved:
                self._refresh_pool()

    # ---- messages --------------------------------------------------------------------

    async def _on_frame(self, conn: WorkerConn, data: str | bytes) -> None:
        if conn.worker_id not in self.conns:
            # Expired while this frame waited in the socket buffer: its tiles are
            # already re-issued; the connection is on its way out.
            raise _Drop(CLOSE_TIMEOUT, "heartbeat timeout")
        conn.last_seen = self.clock()
        # Any frame shows the worker is alive, even one that waits behind a slow check.
        self.scheduler.heartbeat(conn.worker_id, conn.last_seen)
        if isinstance(data, str):
            raise _Drop(CLOSE_POLICY, "text frames are not part of the protocol")
        if conn.messages is not None and conn.messages.reserve(1) > 0.0:
            limit = self.config.max_messages_per_s
            await conn.ws.send(
                encode_message(
                    Error("rate_limited", f"more than max_messages_per_s={limit:g} messages")
                )
            )
            raise _Drop(CLOSE_POLICY, f"message rate over max_messages_per_s={limit:g}")
        try:
            received = parse_message(data, self.config.limits)
        except (FrameError, LimitExceeded) as exc:
            await conn.ws.send(encode_message(Error(exc.code, exc.message)))
            raise _Drop(CLOSE_POLICY, exc.message) from None
        except ProtocolError as exc:
            # Well-framed but not understood (unknown type, bad fields): say so, keep going.
            await conn.ws.send(encode_message(Error(exc.code, exc.message)))
            return
        await self._on_message(conn, received.message, received)

    async def _on_message(self, conn: WorkerConn, msg: Message, received: Received) -> None:
        now = self.clock()
        if isinstance(msg, Result):
            if msg.tile_id in conn.verifying:
                self.counters.duplicates += 1  # the same result again: one check is enough
                return
            # Checked in its own task, so this connection's next frames (heartbeats
            # among them) are read while the verify thread works.
            conn.verifying.add(msg.tile_id)
            self._spawn(self._checked_result(conn, msg, received))
        elif isinstance(msg, Heartbeat):
            self.scheduler.heartbeat(conn.worker_id, now)
            conn.state, conn.reason = msg.state, msg.reason
            credit = self.ledger.get(conn.key)
            await conn.ws.send(encode_message(Ack(msg.seq, credit.tiles, round(credit.gflop, 6))))
        elif isinstance(msg, Error):
            self._on_worker_error(conn, msg)
        elif isinstance(msg, Pause):
            conn.state, conn.reason = "paused", msg.reason
            requeued = self.scheduler.set_paused(conn.worker_id, True, now)
            self._refresh_pool()
            log.info(
                "worker %s paused (%s); %d tiles move elsewhere",
                conn.name,
                msg.reason,
                len(requeued),
            )
            await self._notify_workers_changed()
            self._dispatch()
        elif isinstance(msg, Resume):
            conn.state, conn.reason = "working", ""
            self.scheduler.set_paused(conn.worker_id, False, now)
            self._refresh_pool()
            await self._notify_workers_changed()
            self._dispatch()
        elif isinstance(msg, Bye):
            log.info("worker %s is leaving: %s", conn.name, msg.reason or "no reason given")
            raise _Drop(CLOSE_NORMAL, "bye")
        else:
            await conn.ws.send(
                encode_message(Error("unexpected", f"{msg.TYPE} is not sent by workers"))
            )

    def _on_worker_error(self, conn: WorkerConn, msg: Error) -> None:
        job = self.jobs.get(msg.tile_id)
        if (
            msg.code == "missing_block"
            and job is not None
            and msg.tile_id in self.scheduler.in_flight(conn.worker_id)
        ):
            # Its cache and our mirror of it disagree (it dropped the tile that would
            # have cached a block, say). It emptied its cache; so do we, and resend whole.
            log.info("worker %s lacks an operand block of %s: resending", _who(conn), msg.tile_id)
            conn.blocks.clear()
            frame = self._frame_for(conn, job)
            conn.outbox.put_nowait(frame)
            conn.sent_bytes[job.tile_id] = conn.sent_bytes.get(job.tile_id, 0) + len(frame)
            self.counters.bytes_down += len(frame)
            return
        if msg.tile_id and msg.tile_id in self.scheduler.in_flight(conn.worker_id):
            conn.refused += 1
            self.counters.refused += 1
            log.warning(
                "worker %s refused tile %s: %s: %s", conn.name, msg.tile_id, msg.code, msg.message
            )
            conn.sent_at.pop(msg.tile_id, None)
            self.scheduler.reject(
                conn.worker_id, msg.tile_id, self.clock(), reason=f"refused: {msg.code}"
            )
            self._dispatch()
            self._rescue_stranded()
        else:
            log.warning("worker %s reported %s: %s", conn.name, msg.code, msg.message)

    async def _checked_result(self, conn: WorkerConn, msg: Result, received: Received) -> None:
        try:
            await self._on_result(conn, msg, received)
        except ConnectionClosed:
            pass  # the worker left meanwhile; its tiles are re-issued by _forget
        finally:
            conn.verifying.discard(msg.tile_id)

    async def _on_result(self, conn: WorkerConn, msg: Result, received: Received) -> None:
        conn.last_result_at = self.clock()
        job = self.jobs.get(msg.tile_id)
        if job is None:
            # Done already (a slower copy, or a result after a cancel): nothing to do.
            self.counters.duplicates += 1
            return
        if msg.tile_id not in self.scheduler.in_flight(conn.worker_id):
            self.counters.not_assigned += 1
            await conn.ws.send(
                encode_message(
                    Error("not_assigned", "result for a tile not assigned to you", msg.tile_id)
                )
            )
            return
        try:
            c = received.tensors(self.config.limits).get("c")
        except ProtocolError as exc:
            # Counted as a wrong result (it is one), and the sender is told why.
            c = None
            log.warning("worker %s sent an undecodable result: %s", _who(conn), exc.message)
            with contextlib.suppress(ConnectionClosed):
                await conn.ws.send(encode_message(Error(exc.code, exc.message, msg.tile_id)))
        loop = asyncio.get_running_loop()
        verdict = None
        if c is not None:
            verdict = await loop.run_in_executor(self._verify_pool, self._check, job, c)
        now = self.clock()
        if conn.worker_id not in self.conns:
            # It left (or was banned) while the check ran: its tiles are already
            # re-issued, and a verdict on it would count twice.
            self.counters.duplicates += 1
            return
        if verdict is None or not verdict.ok:
            self._failed_check(conn, msg.tile_id, now, verdict)
            return
        assert c is not None
        completion = self.scheduler.complete(conn.worker_id, msg.tile_id, now)
        if completion.verdict is not Verdict.ACCEPTED:
            self.counters.duplicates += 1
            return
        del self.jobs[msg.tile_id]
        held_s = now - conn.sent_at.pop(msg.tile_id, now)
        self._learn(conn, job, msg, held_s, len(received.frame.payload), now)
        conn.tiles_session += 1
        self.counters.tiles_verified += 1
        self.counters.bytes_up += len(received.frame.payload)
        if job.a.element_size() == 2:
            self.counters.bytes_half += len(received.frame.payload)
        before = self.ledger.get(conn.key)
        reputation = after_verified(before.reputation, self.config.reputation)
        up, compute_s = len(received.frame.payload), min(msg.compute_s, held_s)
        down = conn.sent_bytes.pop(msg.tile_id, len(job.bundle))
        self.ledger.credit(
            conn.key,
            name=conn.name,
            reputation=reputation,
            flops=job.flops,
            bytes_down=down,
            bytes_up=up,
            compute_s=compute_s,
            now=self.wall_clock(),
        )
        for other in completion.cancel:
            self._cancel(other, msg.tile_id)
        self._dispatch()
        finished = await loop.run_in_executor(self._verify_pool, job.gemm.deliver, job.region, c)
        if finished:
            self._gemm_finished(job)

    def _learn(
        self, conn: WorkerConn, job: TileJob, msg: Result, held_s: float, up: int, now: float
    ) -> None:
        """Move the worker's estimate toward what this tile showed. Its claimed compute
        time counts no higher than the time it held the tile; the rest of the round trip
        measures the links only if the tile did not wait behind another one."""
        if conn.estimate is None:
            return
        compute_s = max(0.0, min(msg.compute_s, held_s))
        transfer_s: float | None = None
        if job.tile_id in conn.sent_idle:
            transfer_s = held_s - compute_s
        conn.sent_idle.discard(job.tile_id)
        down = conn.sent_bytes.get(job.tile_id, len(job.bundle))  # what went over the link
        share = down / (down + up) if down + up else 0.0
        conn.estimate = observe(
            conn.estimate,
            TileObservation(
                flops=job.flops,
                down_bytes=down,
                up_bytes=up,
                down_s=transfer_s * share if transfer_s else None,
                compute_s=compute_s,
                up_s=transfer_s * (1 - share) if transfer_s else None,
            ),
            now,
        )
        self._estimates_moved = True

    def _check(self, job: TileJob, c: torch.Tensor) -> CheckResult:
        """The result check, on the verify thread."""
        blocks = job.check_blocks if all(job.blocks) else None
        a, b = job.matrices()
        return check_product(a, b, c, self._check_vectors, cache=self._check_cache, blocks=blocks)

    def _failed_check(
        self, conn: WorkerConn, tile_id: str, now: float, check: CheckResult | None = None
    ) -> None:
        """A wrong result: discard it, re-issue the tile, cut the worker's reputation, and
        ban its key (closing all its connections) once the reputation falls too low."""
        self.counters.rejected += 1
        policy = self.config.reputation
        before = self.ledger.get(conn.key)
        reputation = after_failed(before.reputation, policy)
        banned = ""
        if not before.banned_reason and is_banned(reputation, policy):
            banned = ban_reason(before.rejected + 1, reputation)
        self.ledger.reject(
            conn.key,
            name=conn.name,
            reputation=reputation,
            banned_reason=banned,
            now=self.wall_clock(),
        )
        log.warning(
            "tile %s from %s failed verification (%s; reputation %.2f): re-issuing",
            tile_id,
            _who(conn),
            _why(check),
            reputation,
        )
        conn.sent_at.pop(tile_id, None)
        self.scheduler.reject(conn.worker_id, tile_id, now, reason="failed verification")
        # Tell the worker: an honest volunteer with faulty hardware should learn of it.
        verdict = Error(
            "failed_check",
            f"the result failed verification and was discarded; reputation now {reputation:.2f}",
            tile_id,
        )
        conn.outbox.put_nowait(encode_message(verdict))
        if banned:
            self.counters.banned += 1
            log.warning("banning worker %s: %s", _who(conn), banned)
            for other in [c for c in self.conns.values() if c.key == conn.key]:
                self._spawn(self._ban(other, banned))
        self._dispatch()
        self._rescue_stranded()

    async def _ban(self, conn: WorkerConn, reason: str) -> None:
        with contextlib.suppress(ConnectionClosed):
            await conn.ws.send(encode_message(Error("banned", f"banned: {reason}")))
        await self._forget(conn)  # its tiles move on now, not when the socket closes
        await _close(conn.ws, CLOSE_POLICY, f"banned: {reason}")

    def _gemm_finished(self, job: TileJob) -> None:
        self._forget_gemm(job.gemm.gemm_id)

    def _forget_gemm(self, gemm_id: str) -> None:
        # Keeps the scheduler's record of done tiles bounded by the GEMMs in flight.
        for worker_id, tile_id in self.scheduler.forget_gemm(gemm_id):
            self._cancel(worker_id, tile_id)

    def kept_here(self, gemm_id: str, tiles: int, finished: bool) -> None:
        """The training thread computed `tiles` of a GEMM itself (event loop thread only);
        `finished`: its last tile was one of them, so no result will close the GEMM."""
        self.counters.kept_here += tiles
        if finished:
            self._forget_gemm(gemm_id)

    def _rescue_stranded(self) -> None:
        """Compute here the tiles that no connected worker may take (all refused them,
        or they exceed every memory cap): waiting for them would wait forever."""
        for tile_id in self.scheduler.stranded():
            for worker_id in self.scheduler.take_over(tile_id):
                self._cancel(worker_id, tile_id)
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
            self._spawn(self._compute_here(job))

    async def _compute_here(self, job: TileJob) -> None:
        loop = asyncio.get_running_loop()
        if await loop.run_in_executor(self._verify_pool, _compute_and_deliver, job):
            self._gemm_finished(job)

    def _cancel(self, worker_id: str, tile_id: str) -> None:
        conn = self.conns.get(worker_id)
        if conn is not None:
            conn.outbox.put_nowait(encode_message(Cancel(tile_id)))

    # ---- HTTP ------------------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == WS_PATH:
            return None
        # The address the browser used is the one workers can use too (behind no proxy).
        scheme = "wss" if connection.transport.get_extra_info("ssl_object") else "ws"
        host = request.headers.get("Host") or f"HOST:{self.port}"
        return http_api.respond(
            path,
            status=self.status,
            job_name=self.job_name,
            ws_url_hint=f"{scheme}://{host}{WS_PATH}",
        )

    def status(self) -> dict[str, Any]:
        now = self.clock()
        workers = []
        for conn in self.conns.values():
            standing = self.ledger.get(conn.key)
            workers.append(
                {
                    "id": conn.worker_id,
                    "key": conn.fingerprint,
                    "name": conn.name,
                    "state": conn.state,
                    "reason": conn.reason,
                    "device": conn.profile.device_name or conn.profile.device,
                    "threads": conn.profile.threads,
                    "gflops": conn.profile.gflops,
                    # What its tiles show, which may differ from what it measured at start.
                    "gflops_observed": round(conn.estimate.flops_per_s / 1e9, 2)
                    if conn.estimate is not None
                    else 0.0,
                    "connected_s": round(now - conn.connected_at, 1),
                    "last_seen_s": round(now - conn.last_seen, 1),
                    "in_flight": len(self.scheduler.in_flight(conn.worker_id)),
                    "tiles_session": conn.tiles_session,
                    "refused": conn.refused,
                    "reputation": round(standing.reputation, 4),
                    "contribution": standing.to_json(),
                }
            )
        return {
            **self.status_extra(),
            "job": self.job_name,
            "coordinator_key": fingerprint(self.key),
            "workers": workers,
            "ledger": {c.key_fingerprint: c.to_json() for c in self.ledger.all()},
            "banned": [
                {"key": c.key_fingerprint, "name": c.name, "reason": c.banned_reason}
                for c in self.ledger.banned()
            ],
            "tiles": {
                "sent": self.counters.tiles_sent,
                "verified": self.counters.tiles_verified,
                "reissued": self.counters.reissued,
                "speculated": self.counters.speculated,
                "rejected": self.counters.rejected,
                "refused": self.counters.refused,
                "duplicates": self.counters.duplicates,
                "not_assigned": self.counters.not_assigned,
                "computed_here": self.counters.computed_here,
                "kept_here": self.counters.kept_here,
                "queued": self.scheduler.queued_count(),
                "pending": self.scheduler.pending(),
            },
            "traffic": {
                "bytes_down": self.counters.bytes_down,
                "bytes_down_uncached": self.counters.bytes_down_uncached,
                "bytes_up": self.counters.bytes_up,
                "bytes_half": self.counters.bytes_half,
            },
            "connections": {
                "banned_this_run": self.counters.banned,
                "refused_handshakes": self.counters.refused_handshakes,
                "authenticating": self._handshaking,
            },
        }


def _compute_and_deliver(job: TileJob) -> bool:
    a, b = job.matrices()
    product = torch.bmm(a, b) if job.gemm.op == "bmm" else torch.mm(a, b)
    return job.gemm.deliver(job.region, product)


def _why(check: CheckResult | None) -> str:
    if check is None:
        return "undecodable"
    if check.reason == "mismatch":
        return f"{check.margin:.3g}x its rounding threshold"
    return check.reason


def _who(conn: WorkerConn) -> str:
    """A worker in logs: its chosen name and the key that makes it who it is."""
    return f"{conn.name} [{conn.fingerprint[:9]}]"


def _peer(ws: ServerConnection) -> str:
    try:
        host, port = ws.remote_address[:2]
    except (TypeError, ValueError):
        return "an unknown peer"
    return f"{host}:{port}"


async def _close(ws: ServerConnection, code: int, reason: str) -> None:
    """Close with a reason, reading (and dropping) whatever the peer still sends.

    The peer's closing frame may sit behind a full receive buffer (a flood, or results
    in flight); without the drain the close would wait out its whole timeout.
    """

    async def drain() -> None:
        with contextlib.suppress(ConnectionClosed):
            async for _ in ws:
                pass

    draining = asyncio.create_task(drain())
    try:
        await ws.close(code, _close_reason(reason))
    finally:
        draining.cancel()
        await asyncio.gather(draining, return_exceptions=True)


def _close_reason(text: str) -> str:
    """A WebSocket close reason must fit 123 bytes of UTF-8; ours may quote the peer."""
    return text.encode("utf-8")[:123].decode("utf-8", "ignore")
