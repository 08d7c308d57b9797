"""The loop that applies the owner's policy to a running worker.

An asyncio task, not a thread: the worker core already runs an event loop (in
``cleave-worker`` the main one, in the desktop app a worker thread's), the runner does
almost nothing between samples, and on the loop it needs no locks around the core. The
one sample that may block (macOS's ``ioreg``) runs in a helper thread. ``step()`` is the
whole of one tick and is synchronous, so tests drive it with scripted readings and an
injected clock and never sleep.

It calls ``core.pause(reason)`` / ``core.resume()`` only when the decision changes: a
pause is a message to the coordinator, which moves this worker's tiles elsewhere. It is
also the one owner of the core's CPU share and thread count: it sets them (and names
the mode, "in use" or "idle") at the first step, when they change, and once more after
new settings, and nothing else needs to.
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
from client_app.policy import (
    Decision,
    Limits,
    PolicyConfig,
    Readings,
    Schedule,
    Snooze,
    decide,
)

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0


class Pausable(Protocol):
    """What the runner needs of a WorkerCore (all thread-safe)."""

    def pause(self, reason: str) -> None: ...

    def resume(self) -> None: ...

    def set_cpu_percent(self, percent: int) -> None: ...

    def set_threads(self, threads: int) -> None: ...

    def set_limits_mode(self, mode: str) -> None: ...


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
        cpu_percent=settings.cpu_percent,
        threads=settings.effective_threads,
        in_use_cpu_percent=settings.in_use_cpu_percent,
        in_use_threads=settings.effective_in_use_threads,
        max_cpu_temp_c=settings.max_cpu_temp_c,
        # A GPU the worker does not compute on is not the worker's to cool.
        max_gpu_temp_c=settings.max_gpu_temp_c if settings.use_gpu else 0.0,
        temp_hysteresis_c=settings.temp_hysteresis_c,
    )


def _describe_limits(limits: Limits) -> str:
    if limits.cpu_percent == 0:
        return f"{limits.mode}: paused"
    plural = "" if limits.threads == 1 else "s"
    threads = f", {limits.threads} thread{plural}" if limits.threads else ""
    return f"{limits.mode}: {limits.cpu_percent}% of the time{threads}"


class PolicyRunner:
    """Every ``interval_s``: sample, decide, apply a change of pause or limits to ``core``."""

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
        self._guard = self._config.new_guard()
        self._decision: Decision | None = None  # the one last applied to the core
        self._limits: Limits | None = None  # those last sent; None: send all at the next step
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
        self._set_config(new, resend_limits=True)

    def _set_config(self, new: PolicyConfig, *, resend_limits: bool) -> None:
        with self._lock:
            old = self._config
            self._config = new
            if resend_limits:
                # New settings are the moment to (re)state every limit, changed or not.
                self._limits = None
            # New limits, same hot spells: a part that is hot stays so until it cools.
            self._guard = self._guard.retuned(
                new.max_cpu_temp_c, new.max_gpu_temp_c, new.temp_hysteresis_c
            )
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
        with self._lock:
            config = replace(self._config, snooze=snooze)
        self._set_config(config, resend_limits=False)

    def step(self, reading: Readings | None = None) -> Decision:
        """One tick: sample (unless given), decide, apply a change to the core."""
        if reading is None:
            reading = self._sample()
        with self._lock:
            t = self._monotonic()
            self._detector = self._detector.observe(reading, t)
            self._guard = self._guard.observe(reading, t)
            decision = decide(
                reading,
                self._clock(),
                self._config,
                idle=self._detector.idle,
                too_hot=self._guard.cause,
            )
            sent, self._limits = self._limits, decision.limits
        # Limits first: a resume in this same step then starts with the right ones.
        self._apply_limits(decision.limits, sent)
        self._apply(decision)
        return decision

    def _apply_limits(self, limits: Limits, sent: Limits | None) -> None:
        if sent is None or limits.mode != sent.mode:
            log.info("limits: %s", _describe_limits(limits))
        # 0% comes with an in-use pause, and 0 threads means "not ours to set".
        if limits.cpu_percent >= 1 and (sent is None or limits.cpu_percent != sent.cpu_percent):
            self._core.set_cpu_percent(limits.cpu_percent)
        if limits.threads >= 1 and (sent is None or limits.threads != sent.threads):
            self._core.set_threads(limits.threads)
        if sent is None or limits.mode != sent.mode:
            self._core.set_limits_mode(limits.mode)

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
