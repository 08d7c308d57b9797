"""``cleave-app``: the desktop app against a real coordinator, responsiveness, status
lines, and settings that survive a restart. Qt runs offscreen (conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import Qt, QTimer  # noqa: E402
from PySide6.QtGui import QImage, QKeySequence  # noqa: E402
from PySide6.QtWidgets import QApplication, QLabel, QScrollArea  # noqa: E402
from pytestqt.qtbot import QtBot  # noqa: E402
from support.fake_coordinator import PROFILE, FakeCoordinator, HeldComputer, operands  # noqa: E402
from support.procs import Coordinator, Worker, assert_losses_match, wait_until  # noqa: E402
from support.sample_status import JOB_STATUS  # noqa: E402

from client_app.compute import TileComputer  # noqa: E402
from client_app.config import (  # noqa: E402
    IDENTITY_FILE,
    WorkerSettings,
    config_dir,
    load_identity,
)
from client_app.gui import app as gui_app  # noqa: E402
from client_app.gui.bridge import PauseGate, WorkerBridge  # noqa: E402
from client_app.gui.main_window import MainWindow  # noqa: E402
from client_app.gui.status_text import (  # noqa: E402
    ZERO_WIDTH_SPACE,
    shown_state,
    status_line,
)
from client_app.gui.tray import icon_tooltip, state_icon  # noqa: E402
from client_app.options import WorkerOptions  # noqa: E402
from client_app.policy import Readings  # noqa: E402
from client_app.status import WorkerStatus  # noqa: E402
from common.messages import Result  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def plugged_in() -> Readings:
    # Real readings would pause a test run on a laptop's battery.
    return Readings(other_cpu_percent=0.0, on_battery=False)


def make_window(qtbot: QtBot, settings: WorkerSettings, **core_options: Any) -> MainWindow:
    bridge = WorkerBridge(
        config_dir(),
        core_options=WorkerOptions(**core_options),
        sample=plugged_in,
        policy_interval_s=0.2,
    )
    window = MainWindow(settings, config_dir(), bridge=bridge)
    # Leave and wait for the worker thread before the window goes: a worker outliving
    # its window would report into a deleted bridge during a later test.
    qtbot.addWidget(window, before_close_func=lambda w: w.shutdown())
    window.show()
    return window


def leave_and_wait(qtbot: QtBot, window: MainWindow) -> None:
    if window.bridge.joined:
        window.bridge.leave()
        qtbot.waitUntil(lambda: not window.bridge.joined, timeout=15_000)


# ---- (a) end to end: Join, compute, verified credit, Leave, the run goes on unharmed -------


@pytest.mark.e2e
def test_join_computes_credits_and_leave_loses_nothing(qtbot: QtBot, tmp_path: Path) -> None:
    from coordinator import train_locally
    from coordinator.jobs.tiny_gpt import make_job
    from coordinator.run import EXIT_TERMINATED

    # Far more steps than any machine runs before the credit's Ack (heartbeats are 2 s
    # apart), so the Leave comes mid-run; the run is stopped once it has gone past it.
    steps = 400
    coord = Coordinator(tmp_path, "--steps", str(steps), "--min-workers", "1")
    headless: Worker | None = None
    settings = WorkerSettings(name="gui-w", threads=1, use_gpu=False)
    window = make_window(qtbot, settings, backoff_base_s=0.05)
    seen: list[WorkerStatus] = []
    window.bridge.status_changed.connect(seen.append)
    try:
        window.url_edit.setText(coord.url)
        qtbot.mouseClick(window.join_button, Qt.MouseButton.LeftButton)
        assert window.bridge.joined and window.join_button.text() == "&Leave"

        def counted_by_coordinator() -> bool:
            workers = coord.status()["workers"]
            return any(w["name"] == "gui-w" and w["tiles_session"] > 0 for w in workers)

        # Small tiles finish in milliseconds, so "computing" may be a snapshot the
        # coalescing bridge skips; the tile count says that computing happened.
        qtbot.waitUntil(lambda: window.bridge.status.tiles_done > 0, timeout=60_000)
        assert any(s.state in ("computing", "waiting") for s in seen)
        assert window.fingerprint_label.text() == coord.status()["coordinator_key"]
        qtbot.waitUntil(counted_by_coordinator, timeout=30_000)
        # The coordinator knows this computer by the key the window shows.
        keys = {w["key"] for w in coord.status()["workers"] if w["name"] == "gui-w"}
        assert keys == {window.identity_label.text()}
        # The coordinator's verified figure arrives with a heartbeat's Ack.
        qtbot.waitUntil(lambda: window.bridge.status.credit_tiles > 0, timeout=30_000)
        credit = window.bridge.status.credit_tiles
        assert f"verified ({credit:,} tiles)" == window.contribution_captions["verified"].text()
        if window.stats_view is not None:  # the stats view is someone else's module
            shown = window.stats_view.values()["credit.session"]  # type: ignore[attr-defined]
            assert shown.startswith(f"{credit:,} tiles"), shown

        assert len(coord.steps()) < steps  # leaving mid-run is the point
        qtbot.mouseClick(window.join_button, Qt.MouseButton.LeftButton)  # Leave
        qtbot.waitUntil(lambda: not window.bridge.joined, timeout=15_000)
        assert window.join_button.text() == "&Join" and status_line(window.bridge.status) == "Left"
        # No worker is left. The step left in flight is step `left_at`, or the next if
        # that one's record is not written yet: two more records include it either way.
        left_at = len(coord.steps())
        headless = Worker(tmp_path, coord.url, "headless")
        wait_until(lambda: len(coord.steps()) >= left_at + 2, 60, "two steps after the Leave")
        coord.proc.send_signal(signal.SIGTERM)  # it checkpoints and leaves cleanly
        assert coord.wait(60) == EXIT_TERMINATED, coord.output()
    finally:
        leave_and_wait(qtbot, window)
        if headless is not None:
            headless.stop()
        coord.kill()
    records = coord.steps()
    assert [r["step"] for r in records] == list(range(len(records))), records
    assert len(records) >= left_at + 2
    assert_losses_match([r["loss"] for r in records], train_locally(make_job(), len(records)))


# ---- (b) the event loop stays responsive while a large tile computes ------------------------


class FakeInThread:
    """The loopback tests' fake coordinator on a thread: hands out big tiles and notes
    what the worker sends back."""

    def __init__(self, tiles: int, shape: tuple[int, int, int]) -> None:
        self.tiles, self.shape = tiles, shape
        self.url = ""
        self.results: list[float] = []  # perf_counter when each result arrived
        self.received: list[str] = []  # message type names, heartbeats aside
        self._ready = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    async def _main(self) -> None:
        async with FakeCoordinator(max_size=1 << 28) as coord:
            self.url = coord.url
            self._ready.set()
            link = await coord.next_link(30)
            for i in range(self.tiles):
                a, b = operands(i, self.shape)
                await link.send(coord.task(f"big-{i}", a, b))
            while not self._done.is_set():
                try:
                    received = await asyncio.wait_for(link.inbox.get(), 0.05)
                except asyncio.TimeoutError:
                    continue
                self.received.append(type(received.message).__name__)
                if isinstance(received.message, Result):
                    self.results.append(time.perf_counter())

    def close(self) -> None:
        self._done.set()
        self._thread.join(30)


def event_loop_waits(qtbot: QtBot, seconds: float) -> list[float]:
    """For each millisecond of the next ``seconds``: how long an event posted then would
    have waited for the Qt event loop, i.e. for the next tick of a 5 ms timer. An event
    the test posts itself can't see a stall that began before it was posted."""
    ticks: list[float] = []
    timer = QTimer()
    timer.setTimerType(Qt.TimerType.PreciseTimer)
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    start = time.perf_counter()
    timer.start(5)
    qtbot.wait(round(seconds * 1000))
    timer.stop()
    ticks.append(time.perf_counter())  # the loop is serving this test again
    waits: list[float] = []
    i = 0
    for ms in range(int((ticks[-1] - start) * 1000)):
        instant = start + ms / 1000
        while ticks[i] < instant:
            i += 1
        waits.append(ticks[i] - instant)
    return waits


def described(waits: list[float]) -> str:
    slowest = ", ".join(f"{w:.3f}" for w in sorted(waits)[-3:])
    return f"{len(waits)} waits, median {statistics.median(waits):.4f} s, slowest {slowest} s"


class GemmUntilReleased(HeldComputer):
    """Multiplies the tile's real operands back to back from ``started`` until ``release``:
    a tile that is provably mid-GEMM for as long as a test samples, on any machine."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms: list[tuple[float, float]] = []  # perf_counter span of each GEMM
        self.thread_id = 0

    def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.thread_id = threading.get_ident()
        deadline = time.perf_counter() + 30  # a GEMM loop the test never released
        while True:
            start = time.perf_counter()
            self.started.set()  # after the first GEMM's start is noted
            c = TileComputer.compute(self, op, a, b)
            self.gemms.append((start, time.perf_counter()))
            if self.release.is_set() or time.perf_counter() > deadline:
                return c


def test_event_loop_stays_responsive_while_a_tile_computes(qtbot: QtBot) -> None:
    # The real GEMM runs (looped until released) on the worker's thread while the GUI
    # thread samples; unheld, a big tile could finish before enough samples were taken.
    fake = FakeInThread(tiles=1, shape=(1536, 1536, 1536))  # ~7 GFLOP a GEMM, 1 thread
    computer = GemmUntilReleased()
    settings = WorkerSettings(coordinator_url=fake.url, name="big-w", threads=1, use_gpu=False)
    window = make_window(qtbot, settings, profile=PROFILE, backoff_base_s=0.05, computer=computer)
    try:
        window.join()
        qtbot.waitUntil(lambda: window.bridge.status.state == "computing", timeout=30_000)
        assert computer.started.wait(30)
        sampled_from = time.perf_counter()
        waits = event_loop_waits(qtbot, 0.5)
        sampled_to = time.perf_counter()
        computer.release.set()
        qtbot.waitUntil(lambda: len(fake.results) == fake.tiles, timeout=60_000)
        assert computer.thread_id != threading.get_ident()  # not on the GUI thread
        # Every sample was taken while a GEMM was running.
        gemms = computer.gemms
        assert gemms[0][0] <= sampled_from and gemms[-1][1] >= sampled_to, (
            gemms,
            (sampled_from, sampled_to),
        )
        # A stray stall (the GUI thread descheduled on a loaded machine) is noise; an
        # event loop blocked by the GEMM would keep most events waiting.
        assert statistics.median(waits) < 0.05, described(waits)
        assert max(waits) < 1.0, described(waits)
    finally:
        computer.release.set()
        leave_and_wait(qtbot, window)
        fake.close()


def test_quit_while_a_tile_computes_leaves_cleanly(qtbot: QtBot) -> None:
    fake = FakeInThread(tiles=1, shape=(64, 64, 64))
    computer = HeldComputer()
    settings = WorkerSettings(coordinator_url=fake.url, name="quit-w", threads=1, use_gpu=False)
    window = make_window(qtbot, settings, profile=PROFILE, backoff_base_s=0.05, computer=computer)
    try:
        window.join()
        qtbot.waitUntil(lambda: window.bridge.status.state == "computing", timeout=30_000)
        assert computer.started.wait(30)
        with qtbot.waitSignal(window.quit_done, timeout=10_000):
            window.tray.quit_action.trigger()
        # Leaving does not wait for the GEMM: the Bye tells the coordinator to re-issue.
        assert not window.bridge.joined and status_line(window.bridge.status) == "Left"
        qtbot.waitUntil(lambda: "Bye" in fake.received, timeout=5_000)
        assert "Result" not in fake.received, fake.received
    finally:
        computer.release.set()
        leave_and_wait(qtbot, window)
        fake.close()


def test_settings_dialog_changes_apply_live_and_persist(qtbot: QtBot) -> None:
    fake = FakeInThread(tiles=0, shape=(8, 8, 8))
    settings = WorkerSettings(coordinator_url=fake.url, name="set-w", threads=1, use_gpu=False)
    window = make_window(qtbot, settings, profile=PROFILE, backoff_base_s=0.05)
    try:
        window.join()
        qtbot.waitUntil(lambda: window.bridge.status.state == "waiting", timeout=30_000)
        if not window.settings_button.isVisible():
            pytest.skip("client_app.gui.settings_dialog is not importable")
        qtbot.mouseClick(window.settings_button, Qt.MouseButton.LeftButton)
        dialog = window.settings_dialog
        assert dialog is not None and dialog.isVisible()
        changed = replace(
            window.settings, threads=2, cpu_percent=50, in_use_cpu_percent=40, bandwidth_kbps=512
        )
        dialog.settings_changed.emit(changed)  # type: ignore[attr-defined]
        # The policy runner applies threads and CPU time, the in-use or the idle ones.
        qtbot.waitUntil(lambda: window.bridge.status.threads == 2, timeout=5_000)
        core = window.bridge._core
        assert core is not None
        qtbot.waitUntil(lambda: core.bandwidth_kbps == 512, timeout=5_000)
        mode = window.bridge.status.limits_mode
        assert mode in ("in use", "idle")
        qtbot.waitUntil(lambda: core.cpu_percent == (40 if mode == "in use" else 50), timeout=5_000)
        assert WorkerSettings.load(config_dir()) == changed
        dialog.close()
    finally:
        leave_and_wait(qtbot, window)
        fake.close()


# ---- (c) the status line for every state ---------------------------------------------------


@pytest.mark.parametrize(
    ("state", "core_line", "shown", "look"),
    [
        ("computing", "Computing tile t-12", "Computing", "computing"),
        ("computing", "Resting (CPU limit 50%)", "Computing", "computing"),
        ("waiting", "Waiting for tiles (3 done)", "Connected — waiting for work", "waiting"),
        ("paused", "Paused: computer in use", "Paused: computer in use", "paused"),
        (
            "paused",
            "Paused: CPU at 92 °C, limit 85 °C",
            "Paused: CPU at 92 °C, limit 85 °C",
            "paused",
        ),
        ("paused", "Paused: on battery", "Paused: on battery", "paused"),
        ("paused", "Paused: outside schedule", "Paused: outside schedule", "paused"),
        ("paused", "Paused: paused by you", "Paused: paused by you", "paused"),
        ("paused", "Paused: snoozed until 15:40", "Snoozed until 15:40", "snoozed"),
        ("reconnecting", "Reconnecting in 8 s", "Reconnecting in 8 s", "reconnecting"),
        ("connecting", "Connecting to ws://h/ws", "Connecting to ws://h/ws", "connecting"),
        (
            "refused",
            "Refused: coordinator key changed",
            "Refused: coordinator key changed",
            "refused",
        ),
        ("stopped", "Not joined", "Not joined", "stopped"),
        ("stopped", "Stopped", "Left", "stopped"),
    ],
)
def test_status_line_for_every_state(
    qtbot: QtBot, state: str, core_line: str, shown: str, look: str
) -> None:
    status = WorkerStatus(state=state, line=core_line, current_tile="t-12")
    assert status_line(status) == shown
    assert shown_state(status) == look
    assert not state_icon(look).isNull()
    window = make_window(qtbot, WorkerSettings())
    window.show_status(status)
    assert window.status_label.text() == shown
    assert window.tray.state == look
    assert window.tray.tooltip.splitlines()[1] == shown


# ---- (d) settings survive a restart; tray actions -----------------------------------------


def test_settings_persist_between_two_app_instances(qtbot: QtBot) -> None:
    args = gui_app.build_parser().parse_args(["--coordinator", "ws://127.0.0.1:9/ws"])
    settings, warning = gui_app.load_settings(args)
    assert warning == ""
    first = make_window(qtbot, settings)
    first.apply_settings(replace(first.settings, threads=3, cpu_percent=40, schedule="22:00-07:00"))
    first.tray.snooze_action.trigger()
    assert first.settings.snooze_until

    # A second instance, without --coordinator: everything comes from settings.json.
    again, warning = gui_app.load_settings(gui_app.build_parser().parse_args([]))
    assert warning == ""
    assert again == first.settings
    second = make_window(qtbot, again)
    assert second.url_edit.text() == "ws://127.0.0.1:9/ws"
    assert (again.threads, again.cpu_percent, again.schedule) == (3, 40, "22:00-07:00")
    # The headless worker reads the very same file.
    assert WorkerSettings.load(config_dir()) == again


def test_join_saves_a_name_and_a_bad_url_says_why(qtbot: QtBot) -> None:
    window = make_window(qtbot, WorkerSettings())
    window.url_edit.setText("http://not-a-websocket")
    qtbot.mouseClick(window.join_button, Qt.MouseButton.LeftButton)
    assert not window.bridge.joined
    assert window.status_label.text().startswith("Cannot join: coordinator URL must start")
    window.url_edit.setText("ws://127.0.0.1:9/ws")  # nothing listens: it keeps retrying
    window.tray.join_action.trigger()
    try:
        assert window.bridge.joined and window.tray.join_action.text() == "Leave"
        assert WorkerSettings.load(config_dir()).name  # generated once, then kept
        window.tray.pause_action.setChecked(True)
        assert window.bridge.manually_paused
    finally:
        leave_and_wait(qtbot, window)
    assert window.join_button.text() == "&Join" and window.tray.join_action.text() == "Join"


# ---- (e) the window reads at a glance: the job, the sentence, the contribution -------------


def test_window_shows_the_job_the_sentence_and_the_contribution(qtbot: QtBot) -> None:
    window = make_window(qtbot, WorkerSettings())
    window.show_status(JOB_STATUS)
    assert window.job_name_label.text() == "tiny_gpt"
    assert window.job_description_label.text() == JOB_STATUS.job_description
    assert window.job_meta_label.text() == (
        "Run by Ada's lab · 124 M parameters · step 1,204 of 5,000"
    )
    assert window.job_link_label.text() == "https://example.org/tiny"
    assert window.fingerprint_label.text() == JOB_STATUS.coordinator_fingerprint
    assert window.status_label.text() == "Computing for tiny_gpt — step 1,204 of 5,000"
    assert window.limits_label.text() == (
        "Limits while you use the computer: 30% CPU time, 1 thread"
    )
    assert window.contribution["tiles"].text() == "557"
    assert window.contribution["time"].text() == "0.4 s"  # seconds below a minute
    assert window.contribution["verified"].text() == "2.5 GFLOP"
    assert window.contribution_captions["verified"].text() == "verified (550 tiles)"
    assert window.tray.tooltip == (
        "Cleave — tiny_gpt, step 1,204 of 5,000\n"
        "Computing for tiny_gpt — step 1,204 of 5,000\n"
        "Key 3f9a-c1e2-77b0-94d5-0a6e-51b8-d2f4-8c03"
    )
    # Without a job the panel says how to get one, and the job's other lines go.
    window.show_status(replace(JOB_STATUS, job_name="", state="waiting"))
    assert window.job_name_label.text() == "No job yet"
    assert window.job_meta_label.isHidden() and window.job_link_label.isHidden()
    assert window.status_label.text() == "Connected — waiting for work"


@pytest.mark.parametrize(
    ("line", "shown"),
    [
        ("Paused: CPU at 92 °C, limit 85 °C", "Paused: CPU at 92 °C, limit 85 °C"),
        ("Paused: computer in use", "Paused: computer in use"),
    ],
)
def test_paused_for_heat_or_use_says_so(qtbot: QtBot, line: str, shown: str) -> None:
    window = make_window(qtbot, WorkerSettings())
    window.show_status(replace(JOB_STATUS, state="paused", line=line))
    assert window.status_label.text() == shown
    assert window.limits_label.isHidden()  # no limit is at work while paused
    assert shown in window.tray.tooltip


HOSTILE = "<b>bold</b><img src=x>"


def test_coordinator_text_is_shown_literally(qtbot: QtBot) -> None:
    window = make_window(qtbot, WorkerSettings())
    status = replace(
        JOB_STATUS,
        job_name="<i>name</i>",
        job_description=HOSTILE,
        job_operator="<a href='x'>op</a>",
        job_link="<script>",
        state="waiting",
        note="<u>note</u>",
        detail="<h1>detail</h1>",
    )
    window.show_status(status)
    assert window.job_description_label.text() == HOSTILE
    assert window.job_name_label.text() == "<i>name</i>"
    assert window.job_meta_label.text().startswith("Run by <a href='x'>op</a>")
    assert window.job_link_label.text() == "<script>"
    assert window.status_label.text() == "Connected — <u>note</u>"
    for label in (
        window.job_name_label,
        window.job_description_label,
        window.job_meta_label,
        window.job_link_label,
        window.status_label,
        window.fingerprint_label,
        window.tile_label,
    ):
        assert label.textFormat() == Qt.TextFormat.PlainText, label.accessibleName()
    # Qt shows a tooltip as HTML when it looks like HTML: escaped, it shows the text.
    assert "&lt;h1&gt;detail&lt;/h1&gt;" in window.status_label.toolTip()
    assert window.tray.tooltip.startswith("Cleave — <i>name</i>, step ")
    assert icon_tooltip(window.tray.tooltip, "linux").startswith(
        "<p>Cleave — &lt;i&gt;name&lt;/i&gt;, step "
    )
    assert icon_tooltip(window.tray.tooltip, "win32") == window.tray.tooltip  # native: plain


def visible_labels(window: MainWindow) -> list[QLabel]:
    return [w for w in window.findChildren(QLabel) if w.isVisibleTo(window) and w.text()]


def assert_nothing_clipped(qtbot: QtBot, window: MainWindow) -> None:
    window.grab()  # lays everything out
    qtbot.wait(10)
    for label in visible_labels(window):
        # A label narrower than its text would cut it off; a wrapping one grows instead.
        hint = label.minimumSizeHint() if label.wordWrap() else label.sizeHint()
        assert label.width() >= hint.width(), (label.text(), label.width(), hint.width())
        if label.wordWrap():
            assert label.height() >= label.heightForWidth(label.width()) - 1, label.text()


@pytest.mark.parametrize("font_scale", [1.0, 2.0])
def test_window_reads_at_two_sizes_and_a_doubled_font(qtbot: QtBot, font_scale: float) -> None:
    app = QApplication.instance()
    assert isinstance(app, QApplication)
    old_font = app.font()
    font = app.font()
    font.setPointSizeF(font.pointSizeF() * font_scale)
    app.setFont(font)
    try:
        window = make_window(qtbot, WorkerSettings(coordinator_url="ws://example.org:8765/ws"))
        long = replace(
            JOB_STATUS,
            job_description="A model that learns to write. " * 30,
            job_name="a_rather_long_job_name_" * 3,
        )
        window.show_status(long)
        # The default size, which follows the font: all of it fits across.
        assert_nothing_clipped(qtbot, window)
        scroll = window.centralWidget()
        assert isinstance(scroll, QScrollArea)
        assert scroll.horizontalScrollBar().maximum() == 0
        # Narrower and shorter: text wraps or the area scrolls, nothing is cut off.
        window.resize(window.width() * 3 // 4, window.height() // 2)
        assert_nothing_clipped(qtbot, window)
    finally:
        app.setFont(old_font)


def test_keyboard_reaches_every_control(qtbot: QtBot) -> None:
    window = make_window(qtbot, WorkerSettings())
    assert window.url_edit.nextInFocusChain() is window.join_button
    assert window.join_button.nextInFocusChain() is window.settings_button
    for button in (window.join_button, window.settings_button):
        assert button.focusPolicy() & Qt.FocusPolicy.TabFocus
    assert window.join_button.text() == "&Join"
    assert QKeySequence.mnemonic(window.join_button.text()) == QKeySequence("Alt+J")
    assert QKeySequence.mnemonic(window.settings_button.text()) == QKeySequence("Alt+S")
    for widget in (
        window.url_edit,
        window.join_button,
        window.settings_button,
        window.status_label,
        window.job_name_label,
        window.fingerprint_label,
        window.identity_label,
        window.contribution["tiles"],
    ):
        assert widget.accessibleName(), widget


class RecordingCore:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append((name, args[0] if args else None))


def test_pause_gate_passes_the_runners_limits_to_the_core() -> None:
    core = RecordingCore()
    gate = PauseGate(core)  # type: ignore[arg-type]
    gate.set_cpu_percent(30)
    gate.set_threads(1)
    gate.set_limits_mode("in use")
    gate.pause("computer in use")
    assert core.calls == [
        ("set_cpu_percent", 30),
        ("set_threads", 1),
        ("set_limits_mode", "in use"),
        ("pause", "computer in use"),
    ]


@pytest.mark.e2e
def test_a_real_coordinators_job_and_step_reach_the_window_and_tray(
    qtbot: QtBot, tmp_path: Path
) -> None:
    description = "Sonnets <b>one</b> character at a time.\n<img src=x onerror=alert(1)>"
    coord = Coordinator(
        tmp_path,
        *("--steps", "400", "--checkpoint-every", "1000", "--min-workers", "1"),
        *("--job-description", description, "--job-operator", "Lab <7>"),
    )
    window = make_window(qtbot, WorkerSettings(name="gui-job", threads=1, use_gpu=False))
    try:
        window.url_edit.setText(coord.url)
        qtbot.mouseClick(window.join_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: window.bridge.status.job_step >= 2, timeout=120_000)
        status = window.bridge.status
        assert (status.job_name, status.job_steps) == ("tiny_gpt", 400)
        # The coordinator's words, exactly as sent, and never as markup.
        assert window.job_description_label.text().replace(ZERO_WIDTH_SPACE, "") == description
        assert window.job_description_label.textFormat() == Qt.TextFormat.PlainText
        step = f"step {status.job_step:,} of 400"
        assert window.job_meta_label.text().startswith("Run by Lab <7> · ")
        assert window.job_meta_label.text().endswith(step)
        assert window.fingerprint_label.text() == coord.status()["coordinator_key"]
        if status.state == "computing":
            assert window.status_label.text() == f"Computing for tiny_gpt — {step}"
        tooltip = window.tray.tooltip.split("\n")
        assert tooltip[0] == f"Cleave — tiny_gpt, {step}"
        assert tooltip[1] == window.status_label.text()
        assert tooltip[2] == f"Key {coord.status()['coordinator_key']}"
    finally:
        leave_and_wait(qtbot, window)
        coord.kill()


# ---- (f) the same look offscreen and under a real X server, at 1x and 2x ------------------

PROBE = Path(__file__).resolve().parents[1] / "support" / "window_probe.py"


def _probe(platform: str, scale: int, picture: Path) -> dict[str, Any]:
    env = {**os.environ, "QT_QPA_PLATFORM": platform, "QT_SCALE_FACTOR": str(scale)}
    # A config directory of its own (its history starts empty), all with one worker key.
    config = picture.with_suffix("")
    config.mkdir()
    shutil.copyfile(picture.parent / IDENTITY_FILE, config / IDENTITY_FILE)
    env["CLEAVE_CONFIG_DIR"] = str(config)
    cmd = [sys.executable, str(PROBE), str(picture)]
    if platform == "xcb":  # a real X server of its own, gone when the probe exits
        cmd = ["xvfb-run", "-a", "-s", "-screen 0 2560x1600x24", *cmd]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90, check=False)
    if platform == "xcb" and "Could not load the Qt platform plugin" in done.stderr:
        pytest.skip(f"Qt's xcb plugin does not load here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _pixels(path: Path) -> Any:
    import numpy as np

    image = QImage(str(path)).convertToFormat(QImage.Format.Format_RGB32)
    rows = np.frombuffer(image.constBits(), dtype=np.uint8).reshape(
        image.height(), image.bytesPerLine()
    )
    return np.array(rows[:, : image.width() * 4])  # a copy: the image's buffer goes


@pytest.mark.skipif(shutil.which("xvfb-run") is None, reason="needs xvfb-run (apt install xvfb)")
@pytest.mark.timeout(300)
def test_the_window_looks_the_same_offscreen_and_under_x_at_1x_and_2x(tmp_path: Path) -> None:
    load_identity(tmp_path)  # the worker key every probe shows
    seen: dict[tuple[str, int], dict[str, Any]] = {}
    for platform in ("offscreen", "xcb"):
        for scale in (1, 2):
            seen[platform, scale] = _probe(platform, scale, tmp_path / f"{platform}{scale}.png")
    for (platform, scale), shown in seen.items():
        assert shown["platform"] == platform and shown["pixel_ratio"] == scale, shown
        assert shown["cut_off"] == [], (platform, scale, shown["cut_off"])
        # Scaling enlarges the window's pixels, not its layout: every text is there.
        assert shown["texts"] == seen["offscreen", 1]["texts"], (platform, scale)
        assert shown["size"] == seen["offscreen", 1]["size"], (platform, scale)
    for scale in (1, 2):
        offscreen = _pixels(tmp_path / f"offscreen{scale}.png")
        x11 = _pixels(tmp_path / f"xcb{scale}.png")
        width, height = seen["offscreen", 1]["size"]
        assert offscreen.shape == x11.shape == (height * scale, width * scale * 4)
        # The same fonts and style draw the same picture; a caret or a busy bar's phase
        # may differ in a few pixels.
        assert (offscreen != x11).mean() < 0.02, scale
