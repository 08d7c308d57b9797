"""The asyncio pump around a ``WorkerSession``: sockets, timers, the compute thread.

Per connection, three tasks share one WebSocket: a receive loop feeding the session, a
heartbeat loop, and a compute loop that hands verified tiles, in order, to one
dedicated thread (torch work never runs on the event loop, so heartbeats and cancels
keep flowing while a GEMM runs). Under a CPU-time limit the compute loop rests between
tiles (an asyncio sleep, see ``client_app.duty``): heartbeats, cancels and the prefetch
window carry on while it rests. Losing the connection ends all three; the session
forgets that connection's tiles and the worker reconnects with backoff.

A GUI drives ``WorkerCore`` from its own thread through the thread-safe methods
(``stop``, ``set_threads``, ``set_cpu_percent``, ``set_bandwidth_kbps``, ``pause``,
``resume``) and observes it through ``WorkerStatus`` snapshots (delivered on the
worker's event-loop thread). Under a bandwidth limit (``client_app.bandwidth``) the
receive loop waits after each frame and results wait before they are sent; heartbeats
have their own task and are never held back.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import random
import ssl
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.protocol import State

from client_app.backoff import backoff_delay
from client_app.bandwidth import TokenBucket, bytes_per_s
from client_app.compute import TileComputer
from client_app.config import WorkerSettings
from client_app.duty import DutyCycle, fraction_from_percent
from client_app.profile import build_profile
from client_app.session import Actions, Phase, PinCheck, TileJob, WorkerSession
from client_app.status import StatusObserver, WorkerStatus, refusal_line
from common.limits import DEFAULT_LIMITS
from common.messages import DeviceProfile
from common.signing import generate_private_key

log = logging.getLogger(__name__)

PING_INTERVAL_S = 20.0
OPEN_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
BYE_TIMEOUT_S = 2.0


class RunResult(enum.Enum):
    STOPPED = "stopped"  # asked to stop
    REFUSED = "refused"  # key changed, banned or wrong token: a person must decide


class _Refused(Exception):
    """Raised inside a connection to end the whole run without reconnecting."""


class _NoWelcome(Exception):
    """The coordinator accepted the socket but never welcomed us: try again later."""


class WorkerCore:
    """Joins one coordinator and computes its tiles until stopped or refused."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        pin_check: PinCheck,
        observer: StatusObserver | None = None,
        computer: TileComputer | None = None,
        profile: DeviceProfile | None = None,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 30.0,
        rng: random.Random | None = None,
        max_frame_bytes: int = DEFAULT_LIMITS.max_frame_bytes,
        welcome_timeout_s: float = 30.0,
        summary_every: int = 10,
        summary_min_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        ca_file: str | None = None,
        identity: Ed25519PrivateKey | None = None,
        client_name: str = "cleave-worker",
    ) -> None:
        if not settings.coordinator_url.startswith(("ws://", "wss://")):
            raise ValueError(
                f"coordinator URL must start with ws:// or wss://, not {settings.coordinator_url!r}"
            )
        tls = settings.coordinator_url.startswith("wss://")
        if ca_file is not None and not tls:
            raise ValueError("a CA file applies only to wss:// coordinator URLs")
        # wss://: verify the coordinator's certificate against the system store, plus
        # (or, for a self-signed coordinator, in practice instead of it) the CA file.
        self._ssl: ssl.SSLContext | None = None
        if tls:
            try:
                self._ssl = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"cannot load CA file {ca_file!r}: {exc}") from None
        self.settings = settings
        self.url = settings.coordinator_url
        # The CLI and the app pass the key kept in the config directory; without one
        # (embedded use, tests) this worker is a new identity for this run only.
        self.identity = identity if identity is not None else generate_private_key()
        self._client_name = client_name
        self.computer = computer or TileComputer(settings.effective_threads, settings.use_gpu)
        self._pin_check = pin_check
        self._observers: list[StatusObserver] = [observer] if observer else []
        self._profile = profile
        self._backoff_base_s = backoff_base_s
        self._backoff_cap_s = backoff_cap_s
        self._rng = rng or random.Random()
        self._max_frame_bytes = max_frame_bytes
        self._welcome_timeout_s = welcome_timeout_s
        self._summary_every = summary_every
        self._summary_min_interval_s = summary_min_interval_s
        self._summaries = 0
        self._clock = clock
        # The owner's limit; the event loop alone touches the controller (see _pace).
        self._duty = DutyCycle(fraction_from_percent(settings.cpu_percent))
        # Process CPU time at the last charge (see _compute); None: start afresh.
        self._charge_from: float | None = None
        self._cpu_percent = settings.cpu_percent
        self._resting = False
        self._duty_changed: asyncio.Event | None = None
        # Bandwidth limit, one bucket per direction; like _duty, touched by the loop only.
        self._bandwidth_kbps = settings.bandwidth_kbps
        self._down = TokenBucket(bytes_per_s(settings.bandwidth_kbps), clock=clock)
        self._up = TokenBucket(bytes_per_s(settings.bandwidth_kbps), clock=clock)
        self._bandwidth_changed: asyncio.Event | None = None

        self.session: WorkerSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._started = False
        self._stop_requested = False
        self._pause_reason: str | None = None
        self._stop_event: asyncio.Event | None = None
        self._ws: ClientConnection | None = None
        self._welcomed: asyncio.Event | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._link = "connecting"  # connecting | reconnecting | refused | stopped
        self._line_override = ""
        self._detail = ""
        self._status = WorkerStatus(state="stopped", line="Not started", coordinator_url=self.url)
        # (tiles, compute_s, flop, wall time) when the last summary window started
        self._summary_mark: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)

    # ---- observing ------------------------------------------------------------------

    @property
    def status(self) -> WorkerStatus:
        return self._status

    def add_observer(self, observer: StatusObserver) -> None:
        self._observers.append(observer)
        observer(self._status)

    def remove_observer(self, observer: StatusObserver) -> None:
        with contextlib.suppress(ValueError):
            self._observers.remove(observer)

    # ---- controls (thread-safe) -----------------------------------------------------

    def stop(self) -> None:
        """Leave cleanly: Bye, close, drop the tile in flight. Safe from any thread.

        Returns at once; ``run()`` returns when the worker has left.
        """
        self._stop_requested = True
        self._call_in_loop(self._set_stop_event)

    def set_threads(self, threads: int) -> None:
        """Change the CPU thread cap; it applies from the next tile. Safe from any thread."""
        if threads < 1:
            raise ValueError(f"threads must be >= 1, not {threads}")
        # An int store is atomic; the compute thread reads it before each tile.
        self.computer.threads = threads
        self._call_in_loop(self._publish)

    def set_cpu_percent(self, percent: int) -> None:
        """Change the CPU-time limit (1..100). Safe from any thread.

        It governs the rest after the tile in progress; a rest already under way ends
        at once if the limit was raised, and runs its course if it was lowered.
        """
        fraction_from_percent(percent)  # ValueError here, in the caller's thread
        # An int store is atomic; the event loop hands it to the controller (_pace).
        self._cpu_percent = percent
        self._call_in_loop(self._on_cpu_percent)

    def set_bandwidth_kbps(self, kbps: int) -> None:
        """Change the bandwidth limit (KiB/s each way, 0: unlimited). Safe from any thread.

        A wait under way is recomputed at the new rate (it ends at once when unlimited).
        """
        bytes_per_s(kbps)  # ValueError here, in the caller's thread
        self._bandwidth_kbps = kbps
        self._call_in_loop(self._on_bandwidth)

    def _on_bandwidth(self) -> None:
        rate = bytes_per_s(self._bandwidth_kbps)
        self._down.set_rate(rate)
        self._up.set_rate(rate)
        if self._bandwidth_changed is not None:
            self._bandwidth_changed.set()

    async def _throttle(self, bucket: TokenBucket, n: int) -> None:
        """Charge ``n`` bytes to ``bucket`` and wait until it allows more traffic."""
        assert self._bandwidth_changed is not None
        wait = bucket.reserve(n)
        while wait > 0.0:
            self._bandwidth_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._bandwidth_changed.wait(), wait)
            wait = bucket.wait_s()

    def _on_cpu_percent(self) -> None:
        if self._duty_changed is not None:
            self._duty_changed.set()
        self._publish()

    def pause(self, reason: str) -> None:
        """Stop taking tiles (the coordinator moves them elsewhere). Safe from any thread.

        Before ``run()`` it takes effect at the first join (start paused, e.g. on battery).
        """
        self._pause_reason = reason
        self._call_in_loop(lambda: self._apply(lambda s: s.pause(reason)))

    def resume(self) -> None:
        """Take tiles again after ``pause``. Safe from any thread."""
        self._pause_reason = None
        self._call_in_loop(lambda: self._apply(lambda s: s.resume()))

    def _call_in_loop(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn()
        else:
            loop.call_soon_threadsafe(fn)

    def _set_stop_event(self) -> None:
        if self._stop_event is not None:
            self._stop_event.set()

    def _apply(self, change: Callable[[WorkerSession], Actions]) -> None:
        if self.session is None:
            return
        actions = change(self.session)
        if actions.send and self._ws is not None:
            self._spawn(self._send_soon(self._ws, actions.send))
        self._publish()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_soon(self, ws: ClientConnection, frames: tuple[bytes, ...]) -> None:
        # Fire-and-forget from a control method: a lost connection is the receive
        # loop's to report, and the session re-announces a pause on the next Welcome.
        try:
            await _send(ws, *frames)
        except (ConnectionClosed, OSError) as exc:
            log.debug("could not send to %s: %s", self.url, _describe(exc))

    # ---- running --------------------------------------------------------------------

    async def run(self) -> RunResult:
        """Run until ``stop()`` (-> STOPPED) or a refusal (-> REFUSED; ``status().detail``
        says why: the coordinator's key changed, this worker is banned, a bad token).

        A core runs once (its session ends with a Bye); to join again, make a new one.
        """
        if self._started:
            raise RuntimeError("a WorkerCore runs once; make a new one to join again")
        self._started = True
        loop = asyncio.get_running_loop()
        self._loop = loop
        # Events are made here, not in __init__: they belong to the loop that runs us.
        self._stop_event = asyncio.Event()
        self._welcomed = asyncio.Event()
        self._duty_changed = asyncio.Event()
        self._bandwidth_changed = asyncio.Event()
        self._on_bandwidth()  # a limit set before run() counts from here
        if self._stop_requested:
            self._stop_event.set()
        # One thread for all torch work: tiles run in arrival order, and torch's
        # per-thread intra-op settings (the thread cap) stay on that thread.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cleave-compute")
        result = RunResult.STOPPED
        try:
            self._link = "connecting"
            self._publish(line="Measuring this device")
            profile = self._profile
            if profile is None:
                # Benchmarked on the compute thread, under the thread cap tiles will use.
                measure = partial(build_profile, self.computer, memory_mb=self.settings.memory_mb)
                profile = await loop.run_in_executor(self._executor, measure)
            log.info(
                "device: %s, %s, threads=%d, %.1f GFLOP/s fp32, tile memory cap %d MiB",
                profile.device,
                profile.device_name,
                profile.threads,
                profile.gflops,
                profile.mem_cap_bytes >> 20,
            )
            self.session = WorkerSession(
                self.url,
                name=self.settings.name or "cleave-worker",
                identity=self.identity,
                profile=profile,
                pin_check=self._pin_check,
                window=self.settings.window,
                token=self.settings.join_token,
                # Operands kept between tiles get the same budget as one tile.
                cache_bytes=profile.mem_cap_bytes,
                client=self._client_name,
            )
            if self._pause_reason is not None:
                self.session.pause(self._pause_reason)
            result = await self._connect_loop()
        finally:
            # A GEMM in flight cannot be interrupted; the thread ends after it, unwaited.
            self._executor.shutdown(wait=False, cancel_futures=True)
            for task in list(self._background):
                task.cancel()
            self._link = "refused" if result is RunResult.REFUSED else "stopped"
            self._publish()
            self._loop = None
        return result

    async def _connect_loop(self) -> RunResult:
        assert self._stop_event is not None and self._welcomed is not None
        assert self.session is not None
        attempt = 0
        while not self._stop_event.is_set():
            self._link = "connecting"
            self._welcomed.clear()
            self._publish(line=f"Connecting to {self.url}")
            try:
                await self._one_connection()
                if not self._stop_event.is_set():
                    log.warning("connection to %s was closed", self.url)
            except _Refused as refusal:
                self._detail = str(refusal)
                return RunResult.REFUSED
            except _NoWelcome:
                log.warning("%s sent no welcome within %.0f s", self.url, self._welcome_timeout_s)
            except (OSError, WebSocketException, asyncio.TimeoutError) as exc:
                log.warning("connection to %s ended: %s", self.url, _describe(exc))
            finally:
                self.session.connection_lost()
                self._ws = None
            if self._stop_event.is_set():
                break
            if self._welcomed.is_set():
                attempt = 0  # it worked for a while: start over from short delays
            delay = backoff_delay(
                attempt, base=self._backoff_base_s, cap=self._backoff_cap_s, rng=self._rng
            )
            attempt += 1
            self._link = "reconnecting"
            self._publish(line=f"Reconnecting in {math.ceil(delay)} s")
            log.info("reconnecting to %s in %.1f s", self.url, delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop_event.wait(), timeout=delay)
        return RunResult.STOPPED

    async def _one_connection(self) -> None:
        assert self._stop_event is not None
        # websockets refuses ssl= on a ws:// URL, so pass it only for wss://.
        tls: dict[str, Any] = {"ssl": self._ssl} if self._ssl is not None else {}
        opening = asyncio.ensure_future(
            connect(
                self.url,
                **tls,
                # Deflate on float tensors cuts throughput ~25x and saves almost nothing.
                compression=None,
                max_size=self._max_frame_bytes,
                ping_interval=PING_INTERVAL_S,
                open_timeout=OPEN_TIMEOUT_S,
                close_timeout=CLOSE_TIMEOUT_S,
            )
        )
        # A stop must not wait out the open timeout of an unresponsive host.
        stopping = asyncio.ensure_future(self._stop_event.wait())
        await asyncio.wait({opening, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not opening.done():
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
            return
        ws = opening.result()
        self._ws = ws
        try:
            await self._serve(ws)
        finally:
            await _close_quietly(ws)

    async def _serve(self, ws: ClientConnection) -> None:
        session = self.session
        assert session is not None and self._stop_event is not None
        session.connect(self._clock())  # the coordinator speaks first: its challenge
        self._publish(line=f"Joining {self.url}")
        work = asyncio.Event()
        tasks = {
            asyncio.ensure_future(self._receive_loop(ws, session, work)),
            asyncio.ensure_future(self._heartbeat_loop(ws, session)),
            asyncio.ensure_future(self._compute_loop(ws, session, work)),
            asyncio.ensure_future(self._stop_event.wait()),
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
        if self._stop_event.is_set():
            bye = session.bye("worker stopping")
            if bye is not None:
                with contextlib.suppress(ConnectionClosed, OSError, asyncio.TimeoutError):
                    await asyncio.wait_for(_send(ws, bye), BYE_TIMEOUT_S)
                log.info("left %s (sent bye)", self.url)

    async def _receive_loop(
        self, ws: ClientConnection, session: WorkerSession, work: asyncio.Event
    ) -> None:
        # Ends normally on a clean close; raises ConnectionClosedError on a broken one.
        async for data in ws:
            actions = session.receive(data, self._clock())
            await _send(ws, *actions.send)
            if actions.welcome is not None:
                self._on_welcome(session, actions.first_pin)
            if actions.refusal:
                raise _Refused(actions.refusal)
            if actions.compute:
                work.set()
            if actions.cancel:
                log.debug("cancelled tiles %s", ", ".join(actions.cancel))
            self._publish()
            if actions.close:
                log.info("closing connection to %s: %s", self.url, actions.close)
                return
            # Not reading the next frame is the limit: TCP backpressure slows the sender.
            # Heartbeats are sent by their own task and never wait here.
            await self._throttle(self._down, len(data))

    def _on_welcome(self, session: WorkerSession, first_pin: bool) -> None:
        assert self._welcomed is not None
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
        stats = session.stats
        self._summary_mark = (stats.tiles_done, stats.compute_s, stats.flop_done, self._clock())

    async def _heartbeat_loop(self, ws: ClientConnection, session: WorkerSession) -> None:
        # Doubles as the welcome watchdog: a coordinator that never welcomes is dropped.
        assert self._welcomed is not None
        try:
            await asyncio.wait_for(self._welcomed.wait(), self._welcome_timeout_s)
        except asyncio.TimeoutError:
            raise _NoWelcome() from None
        while True:
            frame = session.heartbeat(self._clock())
            if frame is not None:
                await _send(ws, frame)
            await asyncio.sleep(max(0.0, session.next_heartbeat_at - self._clock()))

    async def _compute_loop(
        self, ws: ClientConnection, session: WorkerSession, work: asyncio.Event
    ) -> None:
        loop = asyncio.get_running_loop()
        assert self._executor is not None
        while True:
            job = session.next_tile()
            if job is None:
                # No await between next_tile() and clear(): no wake-up can be lost.
                work.clear()
                await work.wait()
                # Whatever ran while there was no work (heartbeats) is not owed by
                # the next tile: charging starts afresh.
                self._charge_from = None
                continue
            self._publish()
            start = self._clock()
            cost = 0.0  # a tile that failed is not charged: its cost is unknown
            try:
                c, seconds, cost = await loop.run_in_executor(self._executor, self._compute, job)
            except (RuntimeError, ValueError, MemoryError) as exc:
                frame = session.tile_failed(job, exc)
            else:
                frame = session.tile_finished(job, c, seconds)
                if frame is not None:
                    log.debug(
                        "tile %s: %s %s @ %s %s in %.1f ms",
                        job.tile_id,
                        job.op,
                        list(job.a.shape),
                        list(job.b.shape),
                        job.a.dtype,
                        seconds * 1e3,
                    )
            end = self._clock()
            if frame is not None:
                await self._throttle(self._up, len(frame))
                await _send(ws, frame)
            self._maybe_log_summary(session)
            self._publish()
            await self._pace(start, end, cost)

    def _compute(self, job: TileJob) -> tuple[torch.Tensor, float, float]:
        """``(c, GEMM seconds, cost)``; runs on the compute thread.

        The cost is what the CPU-time limit charges: the process's CPU time since the
        previous tile was charged (this GEMM, plus the decoding, signature checks and
        heartbeats done meanwhile, also while resting) over the thread cap, i.e. the
        share of the granted cores the worker used. Wall time
        would overcharge a GEMM slowed by the owner's own programs, and the compute
        thread's own CPU time (``time.thread_time``) misses torch's other intra-op
        threads. Event-loop work done meanwhile (decoding the next tile) is the
        worker's too and is charged with it. On a GPU the device is what the limit
        occupies, so a tile costs its wall time.
        """
        threads = self.computer.threads
        now_cpu = time.process_time()
        cpu0 = now_cpu if self._charge_from is None else self._charge_from
        start = time.perf_counter()
        c = self.computer.compute(job.op, job.a, job.b)
        seconds = time.perf_counter() - start
        cpu1 = time.process_time()
        self._charge_from = cpu1  # only this (single) compute thread writes it
        if self.computer.device.type == "cpu":
            cost = (cpu1 - cpu0) / threads
        else:
            cost = seconds
        return c, seconds, cost

    async def _pace(self, start: float, end: float, cost: float) -> None:
        """Rest after a tile as long as the CPU-time limit asks (no-op at 100%)."""
        assert self._duty_changed is not None
        self._duty.set_fraction(self._cpu_percent / 100.0)
        rest_s = self._duty.unit_done(start, end, cost)
        if rest_s <= 0.0:
            return
        # Sleeping on the event loop, not the compute thread: heartbeats, cancels and
        # prefetched tiles keep flowing; a stop cancels this task mid-rest.
        deadline = self._clock() + rest_s
        percent = self._cpu_percent
        self._resting = True
        self._publish()
        try:
            while (left := deadline - self._clock()) > 0:
                self._duty_changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._duty_changed.wait(), left)
                if self._cpu_percent > percent:
                    break  # a raised limit owes no more of the rest the old one asked
                percent = self._cpu_percent
        finally:
            self._resting = False
            self._publish()

    def _maybe_log_summary(self, session: WorkerSession) -> None:
        stats = session.stats
        tiles0, compute0, flop0, wall0 = self._summary_mark
        if stats.tiles_done - tiles0 < self._summary_every:
            return
        now = self._clock()
        # Small tiles finish in milliseconds: after the first summary, at most one line
        # per interval keeps the log readable.
        if self._summaries and now - wall0 < self._summary_min_interval_s:
            return
        self._summaries += 1
        busy = stats.compute_s - compute0
        flop = stats.flop_done - flop0
        log.info(
            "computed %d tiles in the last %.1f s (busy %.0f%%, %.1f GFLOP/s); "
            "total %d tiles, %.2f GFLOP; credit %d tiles",
            stats.tiles_done - tiles0,
            now - wall0,
            100.0 * busy / max(now - wall0, 1e-9),
            flop / max(busy, 1e-9) / 1e9,
            stats.tiles_done,
            stats.flop_done / 1e9,
            stats.credit_tiles,
        )
        self._summary_mark = (stats.tiles_done, stats.compute_s, stats.flop_done, now)

    # ---- status ---------------------------------------------------------------------

    def _publish(self, line: str = "") -> None:
        """Tell observers the current status if it changed; ``line`` overrides the text."""
        if line:
            self._line_override = line
        status = self._build_status()
        if status == self._status:
            return
        self._status = status
        for observer in list(self._observers):
            try:
                observer(status)
            except Exception:  # a broken observer (GUI bug) must not stop the worker
                log.exception("status observer %r failed", observer)

    def _build_status(self) -> WorkerStatus:
        session = self.session
        state, line = self._state_and_line()
        extra: dict[str, Any] = {}
        if session is not None:
            stats = session.stats
            extra = {
                "coordinator_fingerprint": session.fingerprint,
                "worker_id": session.worker_id,
                "current_tile": session.current_tile,
                "tiles_done": stats.tiles_done,
                "tiles_refused": stats.tiles_refused,
                "compute_s": stats.compute_s,
                "gflop_done": stats.flop_done / 1e9,
                "bytes_in": stats.bytes_in,
                "bytes_out": stats.bytes_out,
                "credit_tiles": stats.credit_tiles,
                "credit_gflop": stats.credit_gflop,
            }
        return WorkerStatus(
            state=state,
            line=line,
            coordinator_url=self.url,
            detail=self._detail,
            threads=self.computer.threads,
            device=self.computer.device.type,
            **extra,
        )

    def _state_and_line(self) -> tuple[str, str]:
        session = self.session
        if self._link == "refused":
            return "refused", refusal_line(self._detail)
        if self._link == "stopped":
            return "stopped", "Stopped"
        if session is not None and session.phase is Phase.READY:
            if session.paused_reason is not None:
                return "paused", f"Paused: {session.paused_reason}"
            if session.current_tile:
                return "computing", f"Computing tile {session.current_tile}"
            if self._resting:
                # Still "computing": the worker is at work, pacing itself between tiles.
                return "computing", f"Resting (CPU limit {self._cpu_percent}%)"
            return "waiting", f"Waiting for tiles ({session.stats.tiles_done} done)"
        return self._link, self._line_override or f"Connecting to {self.url}"


# DESIGN §6: once the peer closed with 1009 (we sent a frame over its limit) while a
# large frame was still being written, websockets aborts a transport that asyncio has
# already torn down, and send()/close() raise AttributeError ('NoneType' object has no
# attribute 'call_soon'). Only on a connection that is no longer open is that this
# known teardown race; on an open one it would be a real bug and is re-raised.


async def _send(ws: ClientConnection, *frames: bytes) -> None:
    for frame in frames:
        try:
            await ws.send(frame)
        except AttributeError:
            if ws.state is State.OPEN:
                raise
            raise ConnectionAbortedError("connection torn down after the peer closed it") from None


async def _close_quietly(ws: ClientConnection) -> None:
    try:
        await ws.close()
    except AttributeError:
        if ws.state is State.OPEN:
            raise
        log.debug("connection to the coordinator was already torn down")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
