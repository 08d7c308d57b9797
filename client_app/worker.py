"""The asyncio pump around a ``WorkerSession``: sockets, timers, the compute thread.

Each connection runs the tasks of ``client_app.pumps`` (receive, heartbeat, compute,
send) until one ends. Losing the connection ends them all; the session forgets that
connection's tiles and the worker reconnects with backoff. A welcome may send the
worker to another rank of the job; a rank that then stays away sends it back home.

A GUI drives ``WorkerCore`` from its own thread through the thread-safe methods
(``stop``, ``set_threads``, ``set_cpu_percent``, ``set_bandwidth_kbps``, ``pause``,
``resume``) and observes it through ``WorkerStatus`` snapshots (delivered on the
worker's event-loop thread, see ``client_app.status_board``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, WebSocketException

from client_app.backoff import backoff_delay
from client_app.charging import TileCharger
from client_app.compute import TileComputer
from client_app.config import WorkerSettings
from client_app.connection import close_quietly, describe, open_connection, send_frames
from client_app.options import WorkerOptions, tls_context
from client_app.pacing import Pacer
from client_app.profile import build_profile, describe_profile
from client_app.pumps import ConnectionPumps, NoWelcome, Refused
from client_app.refusals import PinCheck
from client_app.session import WorkerSession
from client_app.session_types import Actions
from client_app.status import StatusObserver, WorkerStatus
from client_app.status_board import Activity, Link, StatusBoard
from client_app.summary import TileSummary
from common.messages import DeviceProfile
from common.signing import generate_private_key

log = logging.getLogger(__name__)

BYE_TIMEOUT_S = 2.0


class RunResult(enum.Enum):
    STOPPED = "stopped"  # asked to stop
    REFUSED = "refused"  # key changed, banned or wrong token: a person must decide


# Connections in a row that a rank this worker was sent to does not welcome before it
# goes back to the URL its owner gave.
MISSES_BEFORE_HOME = 3


class WorkerCore:
    """Joins one coordinator and computes its tiles until stopped or refused."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        pin_check: PinCheck,
        options: WorkerOptions | None = None,
        observer: StatusObserver | None = None,
    ) -> None:
        """A bad URL or CA file is a ValueError here (``WorkerOptions`` checks the rest)."""
        options = options or WorkerOptions()
        self._ssl = tls_context(settings.coordinator_url, options.ca_file)
        self.settings = settings
        self.options = options
        self.url = settings.coordinator_url
        # Where the owner pointed this worker; self.url may be another rank of the job
        # that a welcome sent it to, and it comes back here if that rank stays away.
        self.home_url = settings.coordinator_url
        self._moved = False  # the last connection ended with a move: reconnect at once
        self._misses_away = 0  # connections in a row to a rank it was sent to, unwelcomed
        identity = options.identity
        self.identity = identity if identity is not None else generate_private_key()
        self.computer = options.computer or TileComputer(
            settings.effective_threads, settings.use_gpu
        )
        self._pin_check = pin_check
        self._clock = options.clocks.monotonic
        # The limits; the event loop alone touches the controllers (see client_app.pacing).
        self._pacer = Pacer(
            settings.cpu_percent,
            settings.bandwidth_kbps,
            clock=self._clock,
            wait=options.clocks.wait,
            on_rest=self._publish,
        )
        self._charger = TileCharger(
            self.computer,
            process_time=options.clocks.process_time,
            perf_counter=options.clocks.perf_counter,
        )
        self._summary = TileSummary(
            every=options.summary_every, min_interval_s=options.summary_min_interval_s
        )
        self._board = StatusBoard(self.url, observer)

        self.session: WorkerSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._started = False
        self._stop_requested = False
        self._pause_reason: str | None = None
        self._limits_mode = ""
        self._stop_event: asyncio.Event | None = None
        self._ws: ClientConnection | None = None
        self._welcomed: asyncio.Event | None = None
        self._background: set[asyncio.Task[None]] = set()

    # ---- observing ------------------------------------------------------------------

    @property
    def status(self) -> WorkerStatus:
        return self._board.status

    @property
    def cpu_percent(self) -> int:
        """The CPU-time limit in force (the last one set)."""
        return self._pacer.cpu_percent

    @property
    def bandwidth_kbps(self) -> int:
        """The bandwidth limit in force (the last one set; 0: unlimited)."""
        return self._pacer.bandwidth_kbps

    def add_observer(self, observer: StatusObserver) -> None:
        self._board.add_observer(observer)

    def remove_observer(self, observer: StatusObserver) -> None:
        self._board.remove_observer(observer)

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
        self._pacer.request_cpu_percent(percent)  # ValueError here, in the caller's thread
        self._call_in_loop(self._on_cpu_percent)

    def set_bandwidth_kbps(self, kbps: int) -> None:
        """Change the bandwidth limit (KiB/s each way, 0: unlimited). Safe from any thread.

        A wait under way is recomputed at the new rate (it ends at once when unlimited).
        """
        self._pacer.request_bandwidth_kbps(kbps)  # ValueError here, in the caller's thread
        self._call_in_loop(self._pacer.bandwidth_changed)

    def set_limits_mode(self, mode: str) -> None:
        """Name the limits in force ("in use", "idle"; "" unknown) for the status.
        Safe from any thread: the policy runner calls it with each change of limits."""
        self._limits_mode = mode
        self._call_in_loop(self._publish)

    def _on_cpu_percent(self) -> None:
        self._pacer.cpu_percent_changed()
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
            await send_frames(ws, *frames)
        except (ConnectionClosed, OSError) as exc:
            log.debug("could not send to %s: %s", self.url, describe(exc))

    # ---- running --------------------------------------------------------------------

    async def run(self) -> RunResult:
        """Run until ``stop()`` (-> STOPPED) or a refusal (-> REFUSED; ``status().detail``
        says why: the coordinator's key changed, this worker is banned, a bad token).

        A core runs once (its session ends with a Bye); to join again, make a new one.
        """
        if self._started:
            raise RuntimeError("a WorkerCore runs once; make a new one to join again")
        self._started = True
        self._loop = asyncio.get_running_loop()
        # Events are made here, not in __init__: they belong to the loop that runs us.
        self._stop_event = asyncio.Event()
        self._welcomed = asyncio.Event()
        self._pacer.start()
        if self._stop_requested:
            self._stop_event.set()
        # One thread for all torch work: tiles run in arrival order, and torch's
        # per-thread intra-op settings (the thread cap) stay on that thread.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cleave-compute")
        result = RunResult.STOPPED
        try:
            self._board.link = Link.CONNECTING
            self._publish(line="Measuring this device")
            self.session = self._new_session(await self._device_profile())
            if self._pause_reason is not None:
                self.session.pause(self._pause_reason)
            result = await self._connect_loop()
        finally:
            # A GEMM in flight cannot be interrupted; the thread ends after it, unwaited.
            self._executor.shutdown(wait=False, cancel_futures=True)
            for task in list(self._background):
                task.cancel()
            self._board.link = Link.REFUSED if result is RunResult.REFUSED else Link.STOPPED
            self._publish()
            self._loop = None
        return result

    async def _device_profile(self) -> DeviceProfile:
        profile = self.options.profile
        if profile is None:
            # Benchmarked on the compute thread, under the thread cap tiles will use.
            measure = partial(build_profile, self.computer, memory_mb=self.settings.memory_mb)
            loop = asyncio.get_running_loop()
            profile = await loop.run_in_executor(self._executor, measure)
        log.info("device: %s", describe_profile(profile))
        return profile

    def _new_session(self, profile: DeviceProfile) -> WorkerSession:
        return WorkerSession(
            self.url,
            name=self.settings.name or "cleave-worker",
            identity=self.identity,
            profile=profile,
            pin_check=self._pin_check,
            window=self.settings.window,
            token=self.settings.join_token,
            # Operands kept between tiles get the same budget as one tile.
            cache_bytes=profile.mem_cap_bytes,
            client=self.options.client_name,
        )

    async def _connect_loop(self) -> RunResult:
        assert self._stop_event is not None and self._welcomed is not None
        assert self.session is not None
        attempt = 0
        while not self._stop_event.is_set():
            self._board.link = Link.CONNECTING
            self._welcomed.clear()
            self._publish(line=f"Connecting to {self.url}")
            try:
                await self._one_connection()
                if not self._stop_event.is_set() and not self._moved:
                    log.warning("connection to %s was closed", self.url)
            except Refused as refusal:
                self._board.detail = str(refusal)
                return RunResult.REFUSED
            except NoWelcome:
                timeout_s = self.options.welcome_timeout_s
                log.warning("%s sent no welcome within %.0f s", self.url, timeout_s)
            except (OSError, WebSocketException, asyncio.TimeoutError) as exc:
                log.warning("connection to %s ended: %s", self.url, describe(exc))
            finally:
                self.session.connection_lost()
                self._ws = None
            if self._stop_event.is_set():
                break
            if self._moved:
                self._moved = False
                attempt = 0
                continue  # join the rank it was sent to now
            self._count_miss_away()
            if self._welcomed.is_set():
                attempt = 0  # it worked for a while: start over from short delays
            delay = backoff_delay(
                attempt,
                base=self.options.backoff_base_s,
                cap=self.options.backoff_cap_s,
                rng=self.options.rng,
            )
            attempt += 1
            self._board.link = Link.RECONNECTING
            self._publish(line=f"Reconnecting in {math.ceil(delay)} s")
            log.info("reconnecting to %s in %.1f s", self.url, delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop_event.wait(), timeout=delay)
        return RunResult.STOPPED

    async def _one_connection(self) -> None:
        assert self._stop_event is not None
        ws = await open_connection(
            self.url,
            tls=self._ssl,
            max_size=self.options.max_frame_bytes,
            stop=self._stop_event,
        )
        if ws is None:
            return  # stopped while opening
        self._ws = ws
        try:
            await self._serve(ws)
        finally:
            await close_quietly(ws)

    async def _serve(self, ws: ClientConnection) -> None:
        session = self.session
        assert session is not None and self._stop_event is not None
        assert self._executor is not None and self._welcomed is not None
        session.connect(self._clock())  # the coordinator speaks first: its challenge
        self._publish(line=f"Joining {self.url}")
        pumps = ConnectionPumps(
            ws,
            session,
            url=self.url,
            clock=self._clock,
            pacer=self._pacer,
            charger=self._charger,
            summary=self._summary,
            executor=self._executor,
            welcomed=self._welcomed,
            welcome_timeout_s=self.options.welcome_timeout_s,
            publish=self._publish,
            move_to=self._move_to,
        )
        await pumps.run(self._stop_event)
        if self._stop_event.is_set():
            bye = session.bye("worker stopping")
            if bye is not None:
                with contextlib.suppress(ConnectionClosed, OSError, asyncio.TimeoutError):
                    await asyncio.wait_for(send_frames(ws, bye), BYE_TIMEOUT_S)
                log.info("left %s (sent bye)", self.url)

    def _move_to(self, url: str, directed: bool = True) -> None:
        """Serve ``url`` from the next connection on (a rank of the same job and key)."""
        assert self.session is not None
        self.url = self.session.url = self._board.url = url
        self.session.directed = directed
        self._ssl = tls_context(url, self.options.ca_file)
        self._moved = directed
        self._misses_away = 0

    def _count_miss_away(self) -> None:
        """A rank this worker was sent to that does not welcome it three times in a row
        (stopped, or unreachable from here): back to the URL the owner gave."""
        assert self.session is not None and self._welcomed is not None
        if self.url == self.home_url:
            return
        self._misses_away = 0 if self._welcomed.is_set() else self._misses_away + 1
        if self._misses_away >= MISSES_BEFORE_HOME:
            log.warning("%s did not welcome this worker: back to %s", self.url, self.home_url)
            self._move_to(self.home_url, directed=False)

    # ---- status ---------------------------------------------------------------------

    def _publish(self, line: str = "") -> None:
        """Tell observers the current status if it changed; ``line`` overrides the text."""
        activity = Activity(
            threads=self.computer.threads,
            device=self.computer.device.type,
            resting=self._pacer.resting,
            cpu_percent=self._pacer.cpu_percent,
            limits_mode=self._limits_mode,
        )
        self._board.publish(self.session, activity, line)
