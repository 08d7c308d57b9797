"""The loop that applies the owner's policy to a running worker.

An asyncio task, not a thread: the worker core already runs an event loop (in
``cleave-worker`` the main one, in the desktop app a worker thread's), the runner does
almost nothing between samples, and on the loop it needs no locks around the core. The
one sample that may block (macOS's ``ioreg``) runs in a helper thread. ``step()`` is the
whole of one tick and is synchronous, so tests drive it with scripted readings and an
injected clock and never sleep.

It calls ``core.pause(reason)`` / ``core.resume()`` only when the decision changes: a
pause is a message to the coordinator, which moves this worker's tiles elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Protocol

from client_app import readings
from client_app.config import WorkerSettings
from client_app.policy import Decision, PolicyConfig, Readings, Schedule, Snooze, decide

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0


class Pausable(Protocol):
    """What the runner needs of a WorkerCore (thread-safe pause/resume)."""

    def pause(self, reason: str) -> None: ...

    def resume(self) -> None: ...


def local_now() -> datetime:
    """Aware local time, so it compares with an aware ``snooze_until``."""
    return datetime.now().astimezone()


def policy_config(settings: WorkerSettings) -> PolicyConfig:
    """The policy's view of the owner's settings. ValueError for a bad schedule or snooze."""
    snooze = Snooze.from_iso(settings.snooze_until)
    if snooze.until is not None and snooze.until.tzinfo is None:
        # A hand-written naive time means local time; aware keeps comparisons legal.
        snooze = Snooze(snooze.until.astimezone())
    return PolicyConfig(
        idle_only=settings.idle_only,
        idle_threshold_percent=settings.idle_threshold_percent,
        idle_after_s=settings.idle_minutes * 60.0,
        pause_on_battery=settings.pause_on_battery,
        schedule=Schedule.parse(settings.schedule),
        snooze=snooze,
        gpu_only_when_free=settings.use_gpu and settings.gpu_only_when_free,
    )


class PolicyRunner:
    """Every ``interval_s``: sample, decide, pause or resume ``core`` on a change."""

    def __init__(
        self,
        core: Pausable,
        config: PolicyConfig | WorkerSettings,
        *,
        sample: Callable[[], Readings] = readings.sample,
        clock: Callable[[], datetime] = local_now,
        monotonic: Callable[[], float] = time.monotonic,
        interval_s: float = DEFAULT_INTERVAL_S,
        on_decision: Callable[[Decision], None] | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, not {interval_s}")
        self._core = core
        self._sample = sample
        self._clock = clock
        self._monotonic = monotonic
        self.interval_s = interval_s
        self._on_decision = on_decision
        # set_config may come from a GUI thread while step runs on the loop.
        self._lock = threading.Lock()
        self._config = config if isinstance(config, PolicyConfig) else policy_config(config)
        self._detector = self._config.new_detector()
        self._decision: Decision | None = None  # the one last applied to the core
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    @property
    def config(self) -> PolicyConfig:
        return self._config

    @property
    def decision(self) -> Decision | None:
        """The decision last applied; None before the first step."""
        return self._decision

    def set_config(self, config: PolicyConfig | WorkerSettings) -> None:
        """New rules (settings changed, snooze pressed), applied at the next step.

        Safe from any thread; also wakes a running loop so a snooze takes effect at once.
        """
        new = config if isinstance(config, PolicyConfig) else policy_config(config)
        with self._lock:
            old = self._config
            self._config = new
            same_idle_rule = (old.idle_threshold_percent, old.idle_after_s) == (
                new.idle_threshold_percent,
                new.idle_after_s,
            )
            if not same_idle_rule:
                # New thresholds, same history: keep what has been observed so far.
                self._detector = replace(
                    self._detector,
                    threshold=new.idle_threshold_percent,
                    idle_after_s=new.idle_after_s,
                )
        self._wake_loop()

    def snooze(self, snooze: Snooze) -> None:
        """Snooze (or, with ``Snooze()``, wake) now. Safe from any thread."""
        self.set_config(replace(self._config, snooze=snooze))

    def step(self, reading: Readings | None = None) -> Decision:
        """One tick: sample (unless given), decide, apply a change to the core."""
        if reading is None:
            reading = self._sample()
        with self._lock:
            self._detector = self._detector.observe(reading, self._monotonic())
            decision = decide(reading, self._clock(), self._config, idle=self._detector.idle)
        self._apply(decision)
        return decision

    def _apply(self, decision: Decision) -> None:
        previous = self._decision
        self._decision = decision
        # Compare what the core sees: a first "run" needs nothing (a core starts
        # unpaused), a new pause reason is re-sent so the coordinator and status agree.
        was_running = previous is None or previous.run
        if decision.run and not was_running:
            log.info("computing allowed again")
            self._core.resume()
        elif not decision.run and (
            previous is None or previous.run or decision.reason != previous.reason
        ):
            log.info("%s", decision.line)
            self._core.pause(decision.reason)
        if self._on_decision is not None and decision != previous:
            self._on_decision(decision)

    async def run(self) -> None:
        """Tick until ``stop()``; the first tick is immediate."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        try:
            while not self._stopping:
                try:
                    reading = await asyncio.to_thread(self._sample)
                except Exception:
                    # A broken reading must not take the worker down with it: decide
                    # on "unknown", which never pauses for that source.
                    log.exception("could not read the machine's state; treating it as unknown")
                    reading = Readings()
                if self._stopping:
                    break
                self.step(reading)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)
                self._wake.clear()
        finally:
            self._loop = None

    def stop(self) -> None:
        """End ``run()`` soon. Safe from any thread; leaves the core as it is."""
        self._stopping = True
        self._wake_loop()

    def _wake_loop(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(wake.set)
