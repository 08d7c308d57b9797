"""One connection's tasks around a ``WorkerSession``, sharing its WebSocket.

A receive loop feeds the session; a heartbeat loop keeps the coordinator informed (and
drops one that never welcomes); a compute loop hands verified tiles, in order, to one
dedicated thread (torch work never runs on the event loop, so heartbeats and cancels
keep flowing while a GEMM runs), the next one queued there before the last ends, so
that GEMMs run back to back; a send loop encodes and sends each finished tile's
result while the next one computes. The owner's CPU-time and bandwidth limits are waits
here (``client_app.pacing``): a rest between tiles, a wait after each frame received and
before each result sent; heartbeats are never held back. The first task to end ends
them all, and with them the connection.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from websockets.asyncio.client import ClientConnection

from client_app.charging import ChargedTile, TileCharger
from client_app.connection import send_frames
from client_app.pacing import Pacer
from client_app.session import TileJob, WorkerSession
from client_app.summary import TileSummary
from common.batches import packed
from common.messages import Result

log = logging.getLogger("client_app.worker")  # the pump's log, as it has always been

# A finished tile's result and product (encoded by the send loop), or a frame ready to go.
Outgoing = tuple[Result, torch.Tensor] | bytes


class Refused(Exception):
    """Raised inside a connection to end the whole run without reconnecting."""


class NoWelcome(Exception):
    """The coordinator accepted the socket but never welcomed us: try again later."""


class ConnectionPumps:
    """The tasks of one connection to ``url``; ``run`` them until one ends."""

    def __init__(
        self,
        ws: ClientConnection,
        session: WorkerSession,
        *,
        url: str,
        clock: Callable[[], float],
        pacer: Pacer,
        charger: TileCharger,
        summary: TileSummary,
        executor: ThreadPoolExecutor,
        welcomed: asyncio.Event,
        welcome_timeout_s: float,
        publish: Callable[[], None],
        move_to: Callable[[str], None],
    ) -> None:
        """``welcomed`` is set on the coordinator's welcome; ``publish`` tells observers
        the status; ``move_to`` is called with the URL of the rank a welcome sends the
        worker to, as this connection closes."""
        self.ws = ws
        self.session = session
        self.url = url
        self._clock = clock
        self._pacer = pacer
        self._charger = charger
        self._summary = summary
        self._executor = executor
        self._welcomed = welcomed
        self._welcome_timeout_s = welcome_timeout_s
        self._publish = publish
        self._move_to = move_to
        # Tiles handed to the compute thread, in the order it runs them: each with when
        # it was handed over and its future.
        self._running: deque[tuple[TileJob, float, asyncio.Future[ChargedTile | None]]] = deque()

    async def run(self, stop: asyncio.Event) -> None:
        """Until a task ends, or ``stop`` is set; what a task raised is raised here
        (``Refused``, ``NoWelcome``, a broken connection)."""
        work = asyncio.Event()
        # Finished tiles wait here while the next ones compute: as many as the session
        # may hold (the coordinator's window bounds them), so that small tiles finished
        # while a send was under way go out together in one batch.
        outbox: asyncio.Queue[Outgoing] = asyncio.Queue(maxsize=self.session.max_held_tiles)
        tasks = {
            asyncio.ensure_future(self._receive_loop(work)),
            asyncio.ensure_future(self._heartbeat_loop()),
            asyncio.ensure_future(self._compute_loop(work, outbox)),
            asyncio.ensure_future(self._send_loop(outbox)),
            asyncio.ensure_future(stop.wait()),
        }
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            exc = task.exception()
            if exc is not None:
                raise exc

    async def _receive_loop(self, work: asyncio.Event) -> None:
        # Ends normally on a clean close; raises ConnectionClosedError on a broken one.
        ws, session = self.ws, self.session
        async for data in ws:
            actions = session.receive(data, self._clock())
            await send_frames(ws, *actions.send)
            if actions.welcome is not None:
                self._on_welcome(actions.first_pin)
            if actions.refusal:
                raise Refused(actions.refusal)
            if actions.compute:
                work.set()
                if self._depth() > 1:  # else the compute loop stages, after its rest
                    self._stage()
            if actions.cancel:
                log.debug("cancelled tiles %s", ", ".join(actions.cancel))
            self._publish()
            if actions.close:
                log.info("closing connection to %s: %s", self.url, actions.close)
                if actions.move_to:
                    self._move_to(actions.move_to)
                return
            # Not reading the next frame is the limit: TCP backpressure slows the sender.
            # Heartbeats are sent by their own task and never wait here.
            await self._pacer.after_receiving(len(data))

    def _on_welcome(self, first_pin: bool) -> None:
        session = self.session
        self._welcomed.set()
        if first_pin:
            log.info(
                "first join of %s: pinned its key, fingerprint %s. A different key "
                "will be refused.",
                self.url,
                session.fingerprint,
            )
        else:
            log.info(
                "joined %s as %s; coordinator key %s matches the pin",
                self.url,
                session.worker_id,
                session.fingerprint,
            )
        if session.ranks > 1:
            log.info("serving coordinator rank %d of %d", session.rank, session.ranks)
        self._summary.start_window(session.stats, self._clock())

    async def _heartbeat_loop(self) -> None:
        # Doubles as the welcome watchdog: a coordinator that never welcomes is dropped.
        try:
            await asyncio.wait_for(self._welcomed.wait(), self._welcome_timeout_s)
        except asyncio.TimeoutError:
            raise NoWelcome() from None
        while True:
            frame = self.session.heartbeat(self._clock())
            if frame is not None:
                await send_frames(self.ws, frame)
            await asyncio.sleep(max(0.0, self.session.next_heartbeat_at - self._clock()))

    async def _compute_loop(self, work: asyncio.Event, outbox: asyncio.Queue[Outgoing]) -> None:
        running = self._running
        done_at = -math.inf  # when the compute thread finished its last tile
        while True:
            self._stage()
            if not running:
                # No await between _stage() and clear(): no wake-up can be lost.
                work.clear()
                await work.wait()
                continue
            job, submitted_at, future = running[0]
            self._publish()
            outgoing: Outgoing | None
            try:
                charged = await future
            except (RuntimeError, ValueError, MemoryError) as exc:
                # A tile that failed is not charged: its cost is unknown.
                running.popleft()
                outgoing, cost = self.session.tile_failed(job, exc), 0.0
            else:
                running.popleft()
                outgoing, cost = self._finished(job, charged)
            # A tile queued on the compute thread started when the one before it ended.
            start, done_at = max(submitted_at, done_at), self._clock()
            if outgoing is not None:
                await outbox.put(outgoing)  # the next tile computes while this one goes
            self._publish()
            await self._pacer.rest_after_tile(start, done_at, cost)

    def _depth(self) -> int:
        """Tiles the compute thread may hold: two where no rest is owed between tiles,
        so that the next GEMM starts the moment one ends instead of when the event loop,
        busy receiving and checking the tile after, gets round to it; one under a
        CPU-time limit, whose rest falls between tiles."""
        return 2 if self._pacer.cpu_percent >= 100 else 1

    def _stage(self) -> None:
        """Hand the compute thread the tiles it may take (``_depth``)."""
        loop = asyncio.get_running_loop()
        while (job := self.session.next_tile(self._depth())) is not None:
            if not self._running:
                # Whatever ran while there was no work (heartbeats) is not owed by the
                # next tile: charging starts afresh (the compute thread is idle).
                self._charger.start_afresh()
            handed_at = self._clock()  # before: the thread may start (and end) it at once
            future = loop.run_in_executor(self._executor, self._compute, job)
            self._running.append((job, handed_at, future))

    def _compute(self, job: TileJob) -> ChargedTile | None:
        """On the compute thread: ``job``'s product, unless its result stopped being
        wanted while it waited there (cancelled, paused on: None)."""
        if not self.session.wanted(job):
            return None
        return self._charger.compute(job.op, job.a, job.b)

    async def _send_loop(self, outbox: asyncio.Queue[Outgoing]) -> None:
        """Encode and send the finished tiles' frames, while the compute thread is
        already multiplying the next tile; those finished by the time a send is due go
        out together (small ones in one batch, ``common.batches``)."""
        session = self.session
        most = session.limits.max_batch_frames
        while True:
            ready = [await outbox.get()]
            while len(ready) < most and not outbox.empty():
                ready.append(outbox.get_nowait())
            frames = [o if isinstance(o, bytes) else session.result_frame(*o) for o in ready]
            for data in packed(frames, most):
                await self._pacer.before_sending(len(data))
                await send_frames(self.ws, data)
            # Each product's bytes were masked into its frame: its memory is free again.
            for outgoing in ready:
                if not isinstance(outgoing, bytes):
                    self._charger.computer.give_back(outgoing[1])
            self._summary.after_tile(session.stats, self._clock())
            self._publish()

    def _finished(self, job: TileJob, charged: ChargedTile | None) -> tuple[Outgoing | None, float]:
        """What to send for ``job`` (None if not wanted any more) and its cost."""
        if charged is None:  # skipped on the compute thread: its result was not wanted
            self.session.tile_done(job, 0.0)  # books it as cancelled
            return None, 0.0
        result = self.session.tile_done(job, charged.seconds)
        if result is None:
            return None, charged.cost
        log.debug(
            "tile %s: %s %s @ %s %s in %.1f ms",
            job.tile_id,
            job.op,
            list(job.a.shape),
            list(job.b.shape),
            job.a.dtype,
            charged.seconds * 1e3,
        )
        return (result, charged.c), charged.cost
