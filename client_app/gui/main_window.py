"""The main window: coordinator URL, key fingerprint, Join/Leave, status, tile, usage.

A thin view: it shows ``WorkerStatus`` snapshots from the bridge and turns clicks into
bridge calls and saved settings. The stats view and the settings dialog are separate
modules; if one of them cannot be imported the window works without it.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
from PySide6.QtCore import QCoreApplication, Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent, QFont
from PySide6.QtWidgets import (
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from client_app.config import ConfigError, WorkerSettings, load_identity
from client_app.gui.bridge import WorkerBridge
from client_app.gui.status_text import NOT_JOINED, shown_state, status_line
from client_app.gui.tray import Tray, state_icon
from client_app.policy import Snooze
from client_app.policy_runner import local_now
from client_app.status import WorkerStatus
from common.signing import fingerprint

log = logging.getLogger(__name__)

USAGE_INTERVAL_MS = 1000
LEAVE_TIMEOUT_MS = 15_000  # quitting waits this long for a clean leave, then goes anyway

# Sibling views built by others: optional, so the window never depends on their state.
try:
    from client_app.gui.stats_view import StatsView
    from client_app.history import History
except Exception as exc:  # ImportError, or a bug in a module still being written
    log.info("stats view unavailable: %s", exc)
    StatsView = None  # type: ignore[assignment,misc]
    History = None  # type: ignore[assignment,misc]
try:
    from client_app.gui.settings_dialog import SettingsDialog
except Exception as exc:
    log.info("settings dialog unavailable: %s", exc)
    SettingsDialog = None  # type: ignore[assignment,misc]


def device_name() -> str:
    """What the settings dialog calls this machine's compute device."""
    torch = sys.modules.get("torch")  # the worker core has imported it already
    if torch is not None and torch.cuda.is_available():
        return str(torch.cuda.get_device_name(0))
    return platform.processor() or platform.machine() or "CPU"


def gpu_available() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


class MainWindow(QMainWindow):
    """One worker's window. ``quit_done`` fires once a quit has left the coordinator."""

    quit_done = Signal()

    def __init__(
        self,
        settings: WorkerSettings,
        config_directory: Path,
        *,
        bridge: WorkerBridge | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.config_directory = config_directory
        self.bridge = bridge or WorkerBridge(config_directory, self)
        self.bridge.setParent(self)
        self._quitting = False
        self._process = psutil.Process(os.getpid())
        self._process.cpu_percent(None)  # psutil's first reading is always 0.0
        self.history: Any = None
        if History is not None:
            try:
                self.history = History.open(config_directory)
            except Exception as exc:  # a broken history file must not stop the app
                log.warning("no history: %s", exc)
        self.setWindowTitle("Cleave")
        self.setWindowIcon(state_icon("stopped"))
        self._build()
        self.tray = Tray(self)
        self.tray.join_toggled.connect(self.toggle_join)
        self.tray.pause_toggled.connect(self.bridge.set_manual_pause)
        self.tray.snooze_requested.connect(self.snooze_one_hour)
        self.tray.open_requested.connect(self.bring_to_front)
        self.tray.quit_requested.connect(self.quit)
        self.bridge.status_changed.connect(self.show_status)
        self.bridge.finished.connect(self._on_left)
        self._usage_timer = QTimer(self)
        self._usage_timer.timeout.connect(self._update_usage)
        self._usage_timer.start(USAGE_INTERVAL_MS)
        self.show_status(NOT_JOINED)

    # ---- layout ---------------------------------------------------------------------------

    def _identity_text(self) -> str:
        try:
            return fingerprint(load_identity(self.config_directory))
        except ConfigError as exc:
            return f"unusable: {exc}"

    def _build(self) -> None:
        central = QWidget(self)
        layout = QVBoxLayout(central)
        form = QFormLayout()
        self.url_edit = QLineEdit(self.settings.coordinator_url)
        self.url_edit.setPlaceholderText("ws://host:8765/ws")
        form.addRow("Coordinator", self.url_edit)
        self.fingerprint_label = QLabel()
        self.fingerprint_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        form.addRow("Coordinator key", self.fingerprint_label)
        # This computer's identity: credit and reputation follow it, and operators see
        # it next to the name on their dashboard.
        self.identity_label = QLabel(self._identity_text())
        self.identity_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        form.addRow("Your key", self.identity_label)
        layout.addLayout(form)

        self.join_button = QPushButton("Join")
        big = QFont(self.join_button.font())
        big.setPointSizeF(big.pointSizeF() * 1.6)
        big.setBold(True)
        self.join_button.setFont(big)
        self.join_button.setMinimumHeight(56)
        self.join_button.clicked.connect(self.toggle_join)
        layout.addWidget(self.join_button)

        self.status_label = QLabel()
        status_font = QFont(self.status_label.font())
        status_font.setPointSizeF(status_font.pointSizeF() * 1.25)
        self.status_label.setFont(status_font)
        self.status_label.setWordWrap(True)
        layout.addWidget(self.status_label)

        # A GEMM is one call with no progress of its own: the bar is busy while a tile
        # computes, and names it.
        tile_row = QHBoxLayout()
        self.tile_label = QLabel()
        self.tile_bar = QProgressBar()
        self.tile_bar.setTextVisible(False)  # a busy bar draws no text in most styles
        tile_row.addWidget(self.tile_label)
        tile_row.addWidget(self.tile_bar, 1)
        layout.addLayout(tile_row)

        row = QHBoxLayout()
        self.usage_label = QLabel("This app: CPU 0%")
        self.totals_label = QLabel()
        row.addWidget(self.usage_label)
        row.addStretch(1)
        row.addWidget(self.totals_label)
        layout.addLayout(row)

        self.stats_view: QWidget | None = None
        self.settings_dialog: QWidget | None = None
        if StatsView is not None and self.history is not None:
            try:
                self.stats_view = StatsView(self.history, central)
                layout.addWidget(self.stats_view, 1)
            except Exception as exc:
                log.warning("stats view failed: %s", exc)
                self.stats_view = None

        buttons = QHBoxLayout()
        self.settings_button = QPushButton("Settings…")
        self.settings_button.clicked.connect(self.open_settings)
        self.settings_button.setVisible(SettingsDialog is not None)
        buttons.addStretch(1)
        buttons.addWidget(self.settings_button)
        layout.addLayout(buttons)
        layout.addStretch(0)
        self.setCentralWidget(central)
        self.resize(520, 560 if self.stats_view is not None else 300)

    # ---- showing --------------------------------------------------------------------------

    def show_status(self, status: WorkerStatus) -> None:
        joined = self.bridge.joined
        self.status_label.setText(status_line(status))
        self.status_label.setToolTip(status.detail or status.line)
        fp = status.coordinator_fingerprint
        self.fingerprint_label.setText(fp if fp else "not known yet")
        if self.bridge.leaving:
            self.join_button.setText("Leaving…")
            self.join_button.setEnabled(False)
        else:
            self.join_button.setText("Leave" if joined else "Join")
            self.join_button.setEnabled(True)
        self.url_edit.setEnabled(not joined)
        if status.state == "computing" and status.current_tile:
            self.tile_bar.setRange(0, 0)  # busy
            self.tile_label.setText(f"Tile {status.current_tile}")
        else:
            self.tile_bar.setRange(0, 1)
            self.tile_bar.setValue(0)
            self.tile_label.setText("No tile")
        self.totals_label.setText(
            f"{status.tiles_done} tiles computed · {status.credit_tiles} verified"
        )
        self.setWindowIcon(state_icon(shown_state(status)))
        self.tray.update_status(status, joined)
        # The stats view records into the history itself; without it, record here so
        # the figures are there once it is back.
        if self.stats_view is not None:
            self.stats_view.update_status(status)  # type: ignore[attr-defined]
        elif self.history is not None and status.worker_id:
            try:
                self.history.record(status, time.time())
            except Exception as exc:
                log.warning("could not record history: %s", exc)

    def _update_usage(self) -> None:
        # psutil reads /proc (or its equivalents): microseconds, fine on the GUI thread.
        cores = psutil.cpu_count() or 1
        cpu = self._process.cpu_percent(None) / cores
        text = f"This app: CPU {cpu:.0f}%"
        if self.bridge.status.device == "cuda":
            text += f" · GPU {_gpu_use()}"
        self.usage_label.setText(text)

    # ---- actions --------------------------------------------------------------------------

    def toggle_join(self) -> None:
        if self.bridge.joined:
            self.leave()
        else:
            self.join()

    def join(self) -> None:
        url = self.url_edit.text().strip()
        try:
            # A stable generated name lets the operator recognise this machine next time.
            settings = replace(self.settings, coordinator_url=url).with_name()
            self.bridge.join(settings)
        except ValueError as exc:
            self.status_label.setText(f"Cannot join: {exc}")
            return
        self._save(settings)
        self.show_status(self.bridge.status)

    def leave(self) -> None:
        self.bridge.leave()
        self.show_status(self.bridge.status)

    def current_settings(self) -> WorkerSettings:
        """The settings with the URL as typed (it is saved at the next join or change)."""
        if self.bridge.joined:
            return self.settings
        return replace(self.settings, coordinator_url=self.url_edit.text().strip())

    def snooze_one_hour(self) -> None:
        snooze = Snooze.for_duration(local_now())
        self.apply_settings(replace(self.current_settings(), snooze_until=snooze.to_iso()))

    def apply_settings(self, settings: WorkerSettings) -> None:
        """Adopt new settings: saved at once, applied live where the worker can."""
        self._save(settings)
        self.bridge.apply_settings(settings)

    def open_settings(self) -> None:
        if SettingsDialog is None:
            return
        if self.settings_dialog is not None and self.settings_dialog.isVisible():
            self.settings_dialog.raise_()
            return
        dialog = SettingsDialog(
            self.current_settings(),
            device_name=device_name(),
            gpu_available=gpu_available(),
            parent=self,
        )
        dialog.settings_changed.connect(self.apply_settings)
        # Modeless: the window keeps showing the status while the owner tries settings.
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.settings_dialog = dialog
        dialog.show()

    def bring_to_front(self) -> None:
        self.showNormal()
        self.raise_()
        self.activateWindow()

    def quit(self) -> None:
        """Leave first (the coordinator re-issues the tile in flight), then quit."""
        self._quitting = True
        if not self.bridge.joined:
            self.quit_done.emit()
            return
        self.bridge.leave()
        self.show_status(self.bridge.status)
        # A safety net should the leave hang. The window is the timer's context, so the
        # timer dies with the window instead of firing into a deleted one later.
        QTimer.singleShot(LEAVE_TIMEOUT_MS, self, self.quit_done.emit)

    def _on_left(self, _result: object) -> None:
        self.show_status(self.bridge.status)
        if self._quitting:
            self.quit_done.emit()

    def shutdown(self) -> None:
        """Leave (waiting up to 10 s) and close the history: the app is exiting."""
        if self.bridge.joined:
            self.bridge.leave()
            if not self.bridge.wait(10.0):
                log.warning("the worker did not leave within 10 s; quitting anyway")
        self._usage_timer.stop()
        # Deliver what the worker thread queued on its way out while every receiver
        # still exists; delivered after their source is gone they raise in Qt.
        QCoreApplication.sendPostedEvents()
        if self.history is not None:
            try:
                self.history.close()
            except Exception as exc:
                log.warning("could not close the history: %s", exc)
            self.history = None

    def _save(self, settings: WorkerSettings) -> None:
        self.settings = settings
        try:
            settings.save(self.config_directory)
        except (OSError, ConfigError) as exc:
            self.status_label.setText(f"Could not save settings: {exc}")

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 (Qt's name)
        # With a tray the app lives on in it; without one, closing the window quits.
        if self.tray.available and not self._quitting:
            event.ignore()
            self.hide()
            return
        if not self._quitting:
            event.ignore()
            self.quit()
            return
        event.accept()


def _gpu_use() -> str:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return "n/a"
    try:
        return f"{torch.cuda.utilization()}%"  # needs pynvml
    except Exception:
        used = torch.cuda.memory_allocated() / 2**20
        return f"{used:.0f} MiB"
