"""The coordinator's network side: one asyncio process, WebSockets for workers, HTTP status.

This module only moves bytes and time: it listens, runs the handshake, and pumps every
frame, tick and finished check into ``CoordinatorCore`` (``coordinator.pool.core``), which
decides, and carries out the ``Effects`` it answers with. Each connection has one write
path (its outbox, drained by one writer task), so frames leave in the order the core
emitted them. Tiles arrive already encoded and signed from the training thread; results
are checked (Freivalds) and placed on a separate thread, so heartbeats are answered while
the coordinator computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from common.batches import packed
from common.job_about import JobAbout
from common.messages import Hello, JobState, sign_job_state
from common.signing import fingerprint
from coordinator.pool.core import CoordinatorCore, CoreConfig
from coordinator.pool.effects import Check, Checked, Close, CloseCode, Effects, Send
from coordinator.pool.front_door import Direction
from coordinator.pool.ledger import Ledger
from coordinator.pool.workers import Counters, PoolView, Worker
from coordinator.schedule.scheduler import Scheduler
from coordinator.serve import http_api
from coordinator.serve.checks import CheckThread
from coordinator.serve.handshake import (
    WS_PATH,
    Directed,
    Refused,
    close_reason,
    close_unread,
    handshake,
    peer,
)
from coordinator.serve.zero_copy import ZeroCopyConnection
from coordinator.step.cpu_costs import COSTS
from coordinator.tiles.tiled_gemm import SignedTile

log = logging.getLogger("cleave.coordinator")

# A connection the core closed gets this long to send its last words and close cleanly;
# then it is cut (a peer that stopped reading would otherwise hold its writer forever).
# Longer than websockets' own close timeout, which governs a peer that is merely slow.
CLOSE_GRACE_S = 30.0
LEDGER_RETRY_S = 1.0  # after a failed ledger commit, before its writes are tried again


@dataclass(frozen=True)
class ServerConfig:
    """The pump's own settings; what the core decides by is ``core``."""

    core: CoreConfig = field(default_factory=CoreConfig)
    handshake_timeout_s: float = 10.0
    join_token: str = ""  # non-empty: a private pool; workers must prove they know it
    # Connections still authenticating at once: beyond this, new ones are told to come
    # back later, so a flood of idle sockets cannot tie up the coordinator.
    max_handshakes: int = 256
    expire_every_s: float = 0.5
    max_message_bytes: int = 256 << 20  # largest result frame accepted from a worker


@dataclass(eq=False)
class _Connection:
    ws: ServerConnection
    outbox: asyncio.Queue[Send | Close] = field(default_factory=asyncio.Queue)
    closing: Close | None = None  # the core closed it: read and drop until it is gone
    writer: asyncio.Task[None] | None = None


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
        about: JobAbout | None = None,
    ) -> None:
        self.key = key
        self.job_name = job_name
        self.about = about  # sent in each Welcome; None: the name alone
        self.ledger = ledger
        self.config = config
        self.clock = clock
        self.status_extra = status_extra
        # One of several coordinator ranks: its place, said in every welcome, and the
        # front door that sends a joining worker to another rank (set by the run).
        self.rank = 0
        self.ranks = 0
        self.front_door: Callable[[Hello], Direction | None] | None = None
        self.core = CoordinatorCore(
            key=key, ledger=ledger, config=config.core, wall_clock=wall_clock
        )
        self.port = 0
        self._conns: dict[str, _Connection] = {}
        self._checks = CheckThread(config.core.limits)
        self._ledger_writer = ThreadPoolExecutor(
            1,
            thread_name_prefix="cleave-ledger",
            initializer=COSTS.this_thread_is,
            initargs=("ledger",),
        )
        self._server: Server | None = None
        self._handshaking = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._workers_changed = asyncio.Event()
        self._flush_due = False
        self._closed = False
        # The ledger's thread is committing, and looks for more writes before it stops:
        # one commit at a time, each taking every write made while the last one ran.
        self._flushing = False
        self._flush_lock = threading.Lock()
        self._ledger_retry_at = 0.0  # after a failed commit, the next try waits till then
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool = self.core.pool
        self._pool_due = False  # a turn of the loop will take the pool view anew

    # The core's state, for the CLI, the offload and tests.
    @property
    def counters(self) -> Counters:
        return self.core.counters

    @property
    def pool(self) -> PoolView:
        """The pool as the event loop last took it from the core (once a turn, however
        many workers joined or paused in it): a snapshot, safe to read from any thread."""
        return self._pool

    @property
    def conns(self) -> dict[str, Worker]:
        return self.core.workers

    @property
    def tiles(self) -> dict[str, Any]:
        return self.core.tiles

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def active_workers(self) -> int:
        return self.core.active_workers()

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port``; with ``ssl_context``, WebSocket and status are TLS only."""
        COSTS.this_thread_is("event_loop")
        self._loop = asyncio.get_running_loop()
        self._server = await serve(
            self._handle,
            host,
            port,
            ssl=ssl_context,
            compression=None,  # deflate on float data costs most of the throughput
            create_connection=ZeroCopyConnection,  # operand blocks sent without a copy
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
        self._closed = True  # verdicts still on their way change nothing now
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        self._checks.shutdown()
        self._ledger_writer.shutdown(wait=True)
        self.ledger.flush()

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
        while self.core.pool.active < count:
            self._workers_changed.clear()
            await self._workers_changed.wait()

    # ---- work in (event loop thread only) -------------------------------------------

    def submit(self, tiles: list[SignedTile]) -> None:
        """Queue a GEMM's tiles."""
        self._apply(self.core.submit(tiles, self.clock()))

    def set_job_state(self, state: JobState) -> None:
        """Tell every worker how far the training has come (and why none may get tiles).
        Safe from any thread: signed here, handed to the core on the event loop."""
        signed = sign_job_state(self.key, state)
        loop = self._loop
        if loop is None or loop.is_closed():
            self.core.set_job_state(signed)  # not serving yet: the first joins get it
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self.core.set_job_state, signed)

    def kept_here(self, gemm_id: str, tiles: int, finished: bool) -> None:
        """The training thread computed ``tiles`` of a GEMM itself (CoordinatorCore.kept_here)."""
        self._apply(self.core.kept_here(gemm_id, tiles, finished, self.clock()))

    # ---- effects out -----------------------------------------------------------------

    def _apply(self, effects: Effects) -> None:
        for send in effects.sends:
            conn = self._conns.get(send.worker_id)
            if conn is not None and conn.closing is None:
                conn.outbox.put_nowait(send)
        for close in effects.closes:
            conn = self._conns.get(close.worker_id)
            if conn is not None and conn.closing is None:
                conn.closing = close
                conn.outbox.put_nowait(close)
                self._spawn(self._cut_after_grace(conn))
        for check in effects.checks:
            self._checks.submit(check, self._checked)
        for tile in effects.compute_here:
            self._spawn(self._compute_here(tile))
        if effects.workers_changed:
            self._workers_changed.set()
        if self.core.pool_stale and not self._pool_due:
            self._pool_due = True
            asyncio.get_running_loop().call_soon(self._take_pool)
        if not self._flush_due and self.ledger.waiting and self.clock() >= self._ledger_retry_at:
            # The credit of the tiles verified in this turn of the loop, in one commit
            # on the ledger's thread once the turn is over (or in the next one, if a
            # commit is under way: a hand-off to that thread per turn costs more than
            # the commit).
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush_ledger)

    def _take_pool(self) -> None:
        self._pool_due = False
        self._pool = self.core.pool

    def _flush_ledger(self) -> None:
        self._flush_due = False
        if self._closed:
            return  # close() commits what is left, once the ledger's thread has stopped
        with self._flush_lock:
            start, self._flushing = not self._flushing, True
        if start:
            future = self._ledger_writer.submit(self._commit_waiting)
            future.add_done_callback(self._ledger_flushed)

    def _commit_waiting(self) -> None:
        """(On the ledger's thread.) Commit until no write waits."""
        try:
            while True:
                self.ledger.flush()
                with self._flush_lock:
                    if not self.ledger.waiting:
                        self._flushing = False
                        return
        except BaseException:
            # Its writes wait in the ledger for the next try (not at every turn of the
            # loop: a store that is down would be hammered).
            self._ledger_retry_at = self.clock() + LEDGER_RETRY_S
            with self._flush_lock:
                self._flushing = False
            raise

    @staticmethod
    def _ledger_flushed(future: concurrent.futures.Future[None]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.error("could not write the ledger", exc_info=future.exception())

    async def _writer(self, conn: _Connection) -> None:
        """The connection's one write path: its frames in order, then its close. The
        frames that are ready together go out together, small ones in batches."""
        most = self.config.core.limits.max_batch_frames
        with contextlib.suppress(ConnectionClosed):
            while True:
                sends, close = self._ready(conn, await conn.outbox.get(), most)
                # A closing connection's tiles have moved on: only its last words go.
                frames = [s.data for s in sends if conn.closing is None or not s.tile_id]
                for data in packed(frames, most):
                    await conn.ws.send(data)
                if close is not None:
                    await conn.ws.close(close.code, close_reason(close.reason))
                    return

    @staticmethod
    def _ready(
        conn: _Connection, first: Send | Close, most: int
    ) -> tuple[list[Send], Close | None]:
        """``first`` and what else waits in the outbox now (at most ``most`` frames): the
        frames to send together, then the close if one came."""
        sends: list[Send] = []
        item = first
        while not isinstance(item, Close):
            sends.append(item)
            if len(sends) == most or conn.outbox.empty():
                return sends, None
            item = conn.outbox.get_nowait()
        return sends, item

    async def _cut_after_grace(self, conn: _Connection) -> None:
        await asyncio.sleep(CLOSE_GRACE_S)
        if conn.ws.transport is not None and not conn.ws.transport.is_closing():
            conn.ws.transport.abort()

    def _checked(self, check: Check, outcome: Checked | BaseException) -> None:
        if self._closed:
            return
        if isinstance(outcome, BaseException):
            # A bug in the check, not a wrong result: say so, and keep serving.
            log.error("checking tile %s failed", check.tile_id, exc_info=outcome)
            return
        self._apply(self.core.checked(check, outcome, self.clock()))
        if outcome.finished:
            check.tile.gemm.release()

    async def _compute_here(self, tile: SignedTile) -> None:
        finished = await self._checks.compute_here(tile)
        self._apply(self.core.delivered(tile, finished, self.clock()))

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.expire_every_s)
            self._apply(self.core.tick(self.clock()))

    # ---- connections -----------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        if self._handshaking >= self.config.max_handshakes:
            await close_unread(
                ws, CloseCode.TRY_LATER, "too many connections are joining; retry later"
            )
            return
        self._handshaking += 1
        try:
            worker_id, hello = await asyncio.wait_for(
                handshake(
                    ws,
                    key=self.key,
                    core=self.core,
                    config=self.config,
                    job_name=self.job_name,
                    about=self.about,
                    rank=self.rank,
                    ranks=self.ranks,
                    front_door=self.front_door,
                ),
                self.config.handshake_timeout_s,
            )
        except asyncio.TimeoutError:
            self.counters.refused_handshakes += 1
            await close_unread(ws, CloseCode.POLICY, "no valid hello within the handshake timeout")
            return
        except Refused as refused:
            self.counters.refused_handshakes += 1
            log.info("refused a connection from %s: %s", peer(ws), refused.reason)
            await close_unread(ws, refused.code, refused.reason)
            return
        except Directed as directed:
            self.counters.directed += 1
            log.info("a worker from %s was %s", peer(ws), directed.reason)
            await close_unread(ws, CloseCode.NORMAL, directed.reason)
            return
        except ConnectionClosed:
            return
        finally:
            self._handshaking -= 1
        # Registered only now, after the Welcome went out: a client that vanishes during
        # the handshake never becomes a ghost that tiles are queued for.
        conn = _Connection(ws)
        self._conns[worker_id] = conn
        conn.writer = asyncio.create_task(self._writer(conn))
        try:
            self._apply(self.core.admit(worker_id, hello, self.clock()))
            async for data in ws:
                if conn.closing is None:
                    self._apply(self.core.receive(worker_id, data, self.clock()))
        except ConnectionClosed:
            pass
        finally:
            self._apply(self.core.disconnected(worker_id, self.clock()))
            if conn.closing is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.writer, CLOSE_GRACE_S)
            conn.writer.cancel()
            del self._conns[worker_id]

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
        return {
            **self.status_extra(),
            "job": self.job_name,
            "about": None if self.about is None else self.about.to_header(),
            **self.core.status(self.clock()),
            "connections": {
                "banned_this_run": self.counters.banned,
                "refused_handshakes": self.counters.refused_handshakes,
                "directed": self.counters.directed,
                "authenticating": self._handshaking,
            },
        }
