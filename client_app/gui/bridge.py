"""The worker core on a background thread, seen from Qt through signals.

``WorkerCore.run()`` and the ``PolicyRunner`` share one asyncio loop on a thread of
their own, so torch work, network I/O and the policy's sampling never run on the Qt
event loop. Status snapshots cross back through a queued signal; controls cross the
other way through the core's and the runner's thread-safe methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import shiboken6
from PySide6.QtCore import QObject, Qt, Signal, Slot

from client_app.config import PinStore, WorkerSettings, load_identity
from client_app.gui.status_text import MANUAL_PAUSE_REASON, NOT_JOINED
from client_app.options import WorkerOptions
from client_app.policy import Readings
from client_app.policy_runner import DEFAULT_INTERVAL_S, PolicyRunner
from client_app.status import WorkerStatus
from client_app.worker import RunResult, WorkerCore
from common.errors import ConfigError

log = logging.getLogger(__name__)


class PauseGate:
    """The policy's pauses and the owner's Pause button, combined into one core pause.

    The runner only calls ``resume`` when its own decision changes, so without the gate
    a battery that gets plugged in would silently undo the owner's explicit pause.
    Called from the loop thread (policy) and the GUI thread (button): hence the lock.
    """

    def __init__(self, core: WorkerCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._policy_reason: str | None = None
        self._manual = False
        self._applied: str | None = None  # a new core starts unpaused

    def pause(self, reason: str) -> None:
        with self._lock:
            self._policy_reason = reason
            self._sync()

    def resume(self) -> None:
        with self._lock:
            self._policy_reason = None
            self._sync()

    # The runner owns the limits (in-use or idle); they pass straight to the core, whose
    # setters are thread-safe themselves.
    def set_cpu_percent(self, percent: int) -> None:
        self._core.set_cpu_percent(percent)

    def set_threads(self, threads: int) -> None:
        self._core.set_threads(threads)

    def set_limits_mode(self, mode: str) -> None:
        self._core.set_limits_mode(mode)

    def set_manual(self, paused: bool) -> None:
        with self._lock:
            self._manual = paused
            self._sync()

    def _sync(self) -> None:
        # The owner's "not now" wins: it is the one rule no automatic change may undo.
        wanted = MANUAL_PAUSE_REASON if self._manual else self._policy_reason
        if wanted == self._applied:
            return
        self._applied = wanted
        if wanted is None:
            self._core.resume()
        else:
            self._core.pause(wanted)


class WorkerBridge(QObject):
    """Join/leave one coordinator at a time; every status reaches Qt as ``status_changed``."""

    status_changed = Signal(object)  # WorkerStatus, on the GUI thread
    finished = Signal(object)  # RunResult (or None after a crash), once a join has ended
    _status_ready = Signal()  # emitted from the worker thread; queued to the GUI thread
    _ended = Signal(object)  # likewise, with the RunResult, after the last status

    def __init__(
        self,
        config_directory: Path,
        parent: QObject | None = None,
        *,
        core_options: WorkerOptions | None = None,
        sample: Callable[[], Readings] | None = None,
        policy_interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        super().__init__(parent)
        self._directory = config_directory
        # Tests: a fixed profile, fast backoff. The identity and name are the app's own.
        self._core_options = core_options or WorkerOptions()
        self._sample = sample
        self._policy_interval_s = policy_interval_s
        self._lock = threading.Lock()
        self._latest: WorkerStatus = NOT_JOINED  # what the views have been shown
        self._from_core: WorkerStatus | None = None  # newest snapshot, set on the loop thread
        self._pending = False
        self._stop_sent = False
        self._core: WorkerCore | None = None
        self._policy: PolicyRunner | None = None
        self._gate: PauseGate | None = None
        self._thread: threading.Thread | None = None
        self._manual_pause = False
        queued = Qt.ConnectionType.QueuedConnection
        self._status_ready.connect(self._deliver, queued)
        self._ended.connect(self._on_ended, queued)

    # ---- what the views ask -----------------------------------------------------------

    @property
    def status(self) -> WorkerStatus:
        return self._latest

    @property
    def joined(self) -> bool:
        """True from ``join`` until the worker thread has ended (leaving included)."""
        return self._thread is not None

    @property
    def leaving(self) -> bool:
        return self._thread is not None and self._stop_sent

    @property
    def manually_paused(self) -> bool:
        return self._manual_pause

    # ---- controls (GUI thread) ----------------------------------------------------------

    def join(self, settings: WorkerSettings) -> None:
        """Start computing for ``settings.coordinator_url``. ValueError for a bad URL or an
        unusable worker key."""
        if self._thread is not None:
            raise RuntimeError("already joined; leave first")
        try:
            identity = load_identity(self._directory)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        core_options = replace(self._core_options, identity=identity, client_name="cleave-app")
        pin_check = PinStore.in_dir(self._directory).check
        core = WorkerCore(settings, pin_check=pin_check, options=core_options)
        gate = PauseGate(core)
        gate.set_manual(self._manual_pause)
        options: dict[str, Any] = {"interval_s": self._policy_interval_s}
        if self._sample is not None:
            options["sample"] = self._sample
        policy = PolicyRunner(gate, settings, **options)
        self._from_core = None
        self._stop_sent = False
        core.add_observer(self._on_status)
        self._core, self._gate, self._policy = core, gate, policy
        self._thread = threading.Thread(
            target=self._run_thread, args=(core, policy), name="cleave-worker", daemon=True
        )
        self._thread.start()

    def leave(self) -> None:
        """Leave cleanly (Bye; the coordinator re-issues the tile in flight). Returns at once;
        ``finished`` follows when the worker has left."""
        if self._core is not None:
            self._stop_sent = True
            self._core.stop()

    def wait(self, timeout_s: float) -> bool:
        """Block until the worker thread ended (for quitting); True if it did."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def apply_settings(self, settings: WorkerSettings) -> None:
        """Apply live what can change under a running worker: bandwidth and the policy,
        which includes the CPU-time and thread limits.

        The policy runner sets threads and CPU time itself, choosing between the in-use
        and the idle limits; setting them here too would undo its choice until its
        next tick. The URL, GPU use, name, memory cap and window take effect at the
        next join.
        """
        core, policy = self._core, self._policy
        if core is None or policy is None:
            return
        core.set_bandwidth_kbps(settings.bandwidth_kbps)
        policy.set_config(settings)

    def set_manual_pause(self, paused: bool) -> None:
        """The tray's Pause: holds until unticked, whatever the policy says."""
        self._manual_pause = paused
        if self._gate is not None:
            self._gate.set_manual(paused)

    # ---- the worker thread --------------------------------------------------------------

    def _run_thread(self, core: WorkerCore, policy: PolicyRunner) -> None:
        result: RunResult | None = None
        try:
            result = asyncio.run(self._drive(core, policy))
        except Exception:  # a bug must end this join visibly, not kill the app
            log.exception("the worker stopped with an error")
        finally:
            self._finished_from_thread(result)

    @staticmethod
    async def _drive(core: WorkerCore, policy: PolicyRunner) -> RunResult:
        # The policy ticks beside the core and ends with it (as in cleave-worker).
        policy_task = asyncio.ensure_future(policy.run())
        try:
            return await core.run()
        finally:
            policy.stop()
            policy_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await policy_task

    def _on_status(self, status: WorkerStatus) -> None:
        # Runs on the worker's loop thread. Only the newest snapshot matters to a view,
        # so a burst of small tiles queues one Qt event, not hundreds.
        with self._lock:
            self._from_core = status
            if self._pending:
                return
            self._pending = True
        self._emit_from_thread(self._status_ready.emit)

    def _finished_from_thread(self, result: RunResult | None) -> None:
        # Queued events keep their order: the last status arrives before the end.
        self._emit_from_thread(self._status_ready.emit)
        self._emit_from_thread(lambda: self._ended.emit(result))

    def _emit_from_thread(self, emit: Callable[[], None]) -> None:
        # The window (and this bridge with it) may already be gone when the worker
        # thread reports its last words on the way out: then nobody is listening, and
        # PySide would report the emit on a deleted object through sys.excepthook.
        if not shiboken6.isValid(self):
            return
        with contextlib.suppress(RuntimeError):
            emit()

    @Slot()
    def _deliver(self) -> None:
        with self._lock:
            status = self._from_core
            self._pending = False
        if status is None or status == self._latest:
            return
        self._latest = status
        self.status_changed.emit(status)

    @Slot(object)
    def _on_ended(self, result: RunResult | None) -> None:
        if self._thread is not None:
            self._thread.join(5.0)  # it has returned from asyncio.run already
        self._thread = None
        self._core = self._gate = self._policy = None
        self._stop_sent = False
        if result is None:
            self._latest = replace(self._latest, state="stopped", line="Stopped after an error")
            self.status_changed.emit(self._latest)
        self.finished.emit(result)
