"""The main window: what this computer helps, what it does now, what it has given.

Top to bottom: the job (name, description, who runs it, the coordinator's key), the
state as one sentence, this session's contribution in big numbers, then the URL with
Join/Leave, this computer's key, the tile in progress and the stats view.

A thin view: it shows ``WorkerStatus`` snapshots from the bridge and turns clicks into
bridge calls and saved settings. The panels above the stats view are in ``panels``. The
stats view and the settings dialog are separate modules; if one of them cannot be
imported the window works without it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
from PySide6.QtCore import QCoreApplication, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import QFrame, QMainWindow, QScrollArea, QVBoxLayout, QWidget

from client_app import thermal
from client_app.config import WorkerSettings, load_identity
from client_app.gui.bridge import WorkerBridge
from client_app.gui.device_info import device_name, gpu_available, gpu_use
from client_app.gui.panels import ConnectionPanel, ContributionPanel, JobPanel, StateRow
from client_app.gui.status_text import NOT_JOINED, shown_state
from client_app.gui.tray import ICON_SIZE, Tray, state_icon
from client_app.policy import Snooze
from client_app.policy_runner import local_now
from client_app.status import WorkerStatus
from common.errors import ConfigError
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
        # Top to bottom in the order a glance wants: what this computer helps, what it
        # does now, what it has given; then the controls and the history. In a scroll
        # area, so large fonts or 2x scaling scroll instead of clipping.
        content = QWidget()
        layout = QVBoxLayout(content)
        font = self.font()
        self.job_panel = JobPanel(font)
        layout.addWidget(self.job_panel)
        self.state_row = StateRow(font)
        layout.addLayout(self.state_row)
        self.contribution_panel = ContributionPanel(font)
        layout.addWidget(self.contribution_panel)
        self.connection_panel = ConnectionPanel(
            font,
            url=self.settings.coordinator_url,
            identity=self._identity_text(),
            settings_available=SettingsDialog is not None,
        )
        layout.addWidget(self.connection_panel)
        self._name_panel_widgets()
        self.join_button.clicked.connect(self.toggle_join)
        self.url_edit.returnPressed.connect(self._join_from_url)
        self.settings_button.clicked.connect(self.open_settings)

        self.stats_view: QWidget | None = None
        self.settings_dialog: QWidget | None = None
        if StatsView is not None and self.history is not None:
            try:
                self.stats_view = StatsView(self.history, content)
                layout.addWidget(self.stats_view, 1)
            except Exception as exc:
                log.warning("stats view failed: %s", exc)
                self.stats_view = None
        layout.addStretch(0)

        scroll = QScrollArea(self)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        scroll.setWidget(content)
        self.setCentralWidget(scroll)
        self.setTabOrder(self.url_edit, self.join_button)
        self.setTabOrder(self.join_button, self.settings_button)
        em = self.fontMetrics().height()  # sizes follow the font, so scaling scales them
        self.resize(44 * em, (52 if self.stats_view is not None else 32) * em)

    def _name_panel_widgets(self) -> None:
        # The window's own handlers use some of these; tests and docs/screenshots.py
        # reach for the rest here too.
        job, state = self.job_panel, self.state_row
        self.job_name_label = job.name_label
        self.job_description_label = job.description_label
        self.job_meta_label = job.meta_label
        self.job_link_label = job.link_label
        self.fingerprint_label = job.fingerprint_label
        self.state_icon_label = state.icon_label
        self.status_label = state.status_label
        self.limits_label = state.limits_label
        self.contribution = self.contribution_panel.values
        self.contribution_captions = self.contribution_panel.captions
        connection = self.connection_panel
        self.url_edit = connection.url_edit
        self.join_button = connection.join_button
        self.identity_label = connection.identity_label
        self.tile_label = connection.tile_label
        self.tile_bar = connection.tile_bar
        self.usage_label = connection.usage_label
        self.settings_button = connection.settings_button

    # ---- showing --------------------------------------------------------------------------

    def show_status(self, status: WorkerStatus) -> None:
        joined = self.bridge.joined
        look = shown_state(status)
        side = 2 * self.fontMetrics().height()
        icon = state_icon(look, ICON_SIZE).pixmap(QSize(side, side), self.devicePixelRatioF())
        self.job_panel.show_status(status)
        self.state_row.show_status(status, icon)
        self.connection_panel.show_status(status, joined=joined, leaving=self.bridge.leaving)
        self.contribution_panel.show_status(status)
        self.setWindowIcon(state_icon(look))
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
        text = f"CPU {cpu:.0f}%"
        if self.bridge.status.device == "cuda":
            text += f" · GPU {gpu_use()}"
        self.usage_label.setText(text)

    # ---- actions --------------------------------------------------------------------------

    def toggle_join(self) -> None:
        if self.bridge.joined:
            self.leave()
        else:
            self.join()

    def _join_from_url(self) -> None:
        if not self.bridge.joined:
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
        gpu = gpu_available()
        dialog = SettingsDialog(
            self.current_settings(),
            device_name=device_name(),
            gpu_available=gpu,
            cpu_temperature_missing=thermal.cpu_sensor_missing(thermal.cpu_temperature_source()),
            gpu_temperature_missing=thermal.gpu_sensor_missing(
                thermal.gpu_temperature_source(), gpu
            ),
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
