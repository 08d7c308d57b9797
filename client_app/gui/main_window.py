"""The main window: what this computer helps, what it does now, what it has given.

Top to bottom: the job (name, description, who runs it, the coordinator's key), the
state as one sentence, this session's contribution in big numbers, then the URL with
Join/Leave, this computer's key, the tile in progress and the stats view.

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
from PySide6.QtCore import QCoreApplication, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent, QFont
from PySide6.QtWidgets import (
    QFormLayout,
    QFrame,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from client_app import thermal
from client_app.config import WorkerSettings, load_identity
from client_app.gui.bridge import WorkerBridge
from client_app.gui.status_text import (
    NOT_JOINED,
    breakable,
    clean_text,
    html_for_plain,
    job_about,
    limits_line,
    progress_text,
    rank_text,
    shown_state,
    status_line,
)
from client_app.gui.tray import ICON_SIZE, Tray, state_icon
from client_app.gui.units import format_count, format_duration, format_gflop
from client_app.policy import Snooze
from client_app.policy_runner import local_now
from client_app.status import WorkerStatus
from common.errors import ConfigError
from common.signing import fingerprint

log = logging.getLogger(__name__)

USAGE_INTERVAL_MS = 1000
LEAVE_TIMEOUT_MS = 15_000  # quitting waits this long for a clean leave, then goes anyway
JOIN_TEXT = "&Join"  # Alt+J
LEAVE_TEXT = "&Leave"  # Alt+L

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


def scaled_font(base: QFont, factor: float, *, bold: bool = False) -> QFont:
    """``base`` times ``factor``: relative sizes keep the window's proportions at any
    system font size or display scale."""
    font = QFont(base)
    if font.pointSizeF() > 0:
        font.setPointSizeF(font.pointSizeF() * factor)
    else:  # a font set in pixels
        font.setPixelSize(max(1, round(font.pixelSize() * factor)))
    font.setBold(bold)
    return font


def _plain_label(font: QFont | None = None, *, wrap: bool = True) -> QLabel:
    """A label for text that may come from the coordinator: never interpreted as HTML,
    selectable, wrapped unless it is one unbreakable token (a key)."""
    label = QLabel()
    label.setTextFormat(Qt.TextFormat.PlainText)
    label.setWordWrap(wrap)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    if font is not None:
        label.setFont(font)
    return label


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
        # Top to bottom in the order a glance wants: what this computer helps, what it
        # does now, what it has given; then the controls and the history. In a scroll
        # area, so large fonts or 2x scaling scroll instead of clipping.
        content = QWidget()
        layout = QVBoxLayout(content)
        layout.addWidget(self._build_about())
        layout.addLayout(self._build_state())
        layout.addWidget(self._build_contribution())
        layout.addWidget(self._build_details())

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

    def _build_about(self) -> QGroupBox:
        box = QGroupBox("What this computer helps")
        column = QVBoxLayout(box)
        self.job_name_label = _plain_label(scaled_font(self.font(), 1.35, bold=True))
        self.job_name_label.setAccessibleName("Training job")
        self.job_description_label = _plain_label()
        self.job_description_label.setAccessibleName("Job description")
        self.job_meta_label = _plain_label()  # "Run by ... · 124 M parameters"
        self.job_meta_label.setAccessibleName("Who runs the job, and the model's size")
        self.job_link_label = _plain_label()  # text only: a stranger's link is not clicked
        self.job_link_label.setAccessibleName("The job's web page")
        for label in (
            self.job_name_label,
            self.job_description_label,
            self.job_meta_label,
            self.job_link_label,
        ):
            column.addWidget(label)
        key_row = QHBoxLayout()
        key_caption = QLabel("Coordinator key:")
        self.fingerprint_label = _plain_label(wrap=False)
        self.fingerprint_label.setAccessibleName("Coordinator key")
        self.fingerprint_label.setToolTip(
            "The fingerprint of the key this coordinator signs its work with. It is "
            "remembered at the first join; a different key later stops the app."
        )
        key_row.addWidget(key_caption)
        key_row.addWidget(self.fingerprint_label, 1)
        column.addLayout(key_row)
        return box

    def _build_state(self) -> QHBoxLayout:
        row = QHBoxLayout()
        self.state_icon_label = QLabel()
        self.state_icon_label.setAccessibleName("State icon")
        row.addWidget(self.state_icon_label, 0, Qt.AlignmentFlag.AlignTop)
        column = QVBoxLayout()
        self.status_label = _plain_label(scaled_font(self.font(), 1.5, bold=True))
        self.status_label.setAccessibleName("State")
        self.limits_label = _plain_label()
        self.limits_label.setAccessibleName("Limits in force")
        column.addWidget(self.status_label)
        column.addWidget(self.limits_label)
        row.addLayout(column, 1)
        return row

    def _build_contribution(self) -> QGroupBox:
        box = QGroupBox("This session")
        grid = QGridLayout(box)
        big = scaled_font(self.font(), 1.8, bold=True)
        self.contribution: dict[str, QLabel] = {}
        self.contribution_captions: dict[str, QLabel] = {}
        for col, (key, caption, tip) in enumerate(
            (
                ("tiles", "tiles computed", "Pieces of work this computer finished."),
                (
                    "verified",
                    "verified",
                    "Work the coordinator checked and accepted, from its ledger.",
                ),
                ("time", "time computing", "Time spent multiplying matrices."),
            )
        ):
            value = QLabel()
            value.setFont(big)
            value.setAlignment(Qt.AlignmentFlag.AlignCenter)
            value.setAccessibleName(caption.capitalize())
            value.setToolTip(tip)
            value.setTextFormat(Qt.TextFormat.PlainText)
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            note = QLabel(caption)
            note.setAlignment(Qt.AlignmentFlag.AlignCenter)
            note.setToolTip(tip)
            note.setWordWrap(True)
            grid.addWidget(value, 0, col)
            grid.addWidget(note, 1, col)
            grid.setColumnStretch(col, 1)
            self.contribution[key] = value
            self.contribution_captions[key] = note
        return box

    def _build_details(self) -> QGroupBox:
        box = QGroupBox("Connection")
        form = QFormLayout(box)
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        self.url_edit = QLineEdit(self.settings.coordinator_url)
        self.url_edit.setPlaceholderText("ws://host:8765/ws")
        self.url_edit.setAccessibleName("Coordinator URL")
        self.join_button = QPushButton(JOIN_TEXT)
        self.join_button.setFont(scaled_font(self.font(), 1.25, bold=True))
        self.join_button.setDefault(True)  # Enter in the URL field joins
        self.join_button.setAccessibleName("Join or leave the coordinator")
        self.join_button.clicked.connect(self.toggle_join)
        url_row = QHBoxLayout()
        url_row.addWidget(self.url_edit, 1)
        url_row.addWidget(self.join_button)
        url_label = QLabel("Coordinator &URL:")
        url_label.setBuddy(self.url_edit)
        form.addRow(url_label, url_row)
        self.url_edit.returnPressed.connect(self._join_from_url)

        # This computer's identity: credit and reputation follow it, and operators see
        # it next to the name on their dashboard.
        self.identity_label = _plain_label(wrap=False)
        self.identity_label.setText(self._identity_text())
        self.identity_label.setAccessibleName("Your key")
        form.addRow("Your key:", self.identity_label)

        # A GEMM is one call with no progress of its own: the bar is busy while a tile
        # computes, and names it.
        tile_row = QHBoxLayout()
        self.tile_label = _plain_label(wrap=False)
        self.tile_bar = QProgressBar()
        self.tile_bar.setTextVisible(False)  # a busy bar draws no text in most styles
        self.tile_bar.setAccessibleName("Tile progress")
        tile_row.addWidget(self.tile_label)
        tile_row.addWidget(self.tile_bar, 1)
        form.addRow("Tile:", tile_row)

        usage_row = QHBoxLayout()
        self.usage_label = QLabel("CPU 0%")
        self.settings_button = QPushButton("&Settings…")
        self.settings_button.setAccessibleName("Settings")
        self.settings_button.clicked.connect(self.open_settings)
        self.settings_button.setVisible(SettingsDialog is not None)
        usage_row.addWidget(self.usage_label, 1)
        usage_row.addWidget(self.settings_button)
        form.addRow("This app:", usage_row)
        return box

    # ---- showing --------------------------------------------------------------------------

    def show_status(self, status: WorkerStatus) -> None:
        joined = self.bridge.joined
        self._show_about(status)
        self.status_label.setText(breakable(status_line(status)))
        self.status_label.setToolTip(html_for_plain(status.detail or status.line))
        limits = limits_line(status)
        self.limits_label.setText(limits)
        self.limits_label.setVisible(bool(limits))
        look = shown_state(status)
        side = 2 * self.fontMetrics().height()
        self.state_icon_label.setPixmap(
            state_icon(look, ICON_SIZE).pixmap(QSize(side, side), self.devicePixelRatioF())
        )
        if self.bridge.leaving:
            self.join_button.setText("Leaving…")
            self.join_button.setEnabled(False)
        else:
            self.join_button.setText(LEAVE_TEXT if joined else JOIN_TEXT)
            self.join_button.setEnabled(True)
        self.url_edit.setEnabled(not joined)
        if status.state == "computing" and status.current_tile:
            self.tile_bar.setRange(0, 0)  # busy
            self.tile_label.setText(clean_text(status.current_tile, 60))
        else:
            self.tile_bar.setRange(0, 1)
            self.tile_bar.setValue(0)
            self.tile_label.setText("none")
        self.contribution["tiles"].setText(format_count(status.tiles_done))
        self.contribution["verified"].setText(format_gflop(status.credit_gflop))
        self.contribution_captions["verified"].setText(
            f"verified ({format_count(status.credit_tiles)} tiles)"
        )
        self.contribution["time"].setText(format_duration(status.compute_s))
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

    def _show_about(self, status: WorkerStatus) -> None:
        about = job_about(status)
        fp = status.coordinator_fingerprint
        self.fingerprint_label.setText(fp + rank_text(status, " · ") if fp else "not known yet")
        if not about.name:
            self.job_name_label.setText("No job yet")
            self.job_description_label.setText(
                "Join a coordinator to see the training job this computer helps."
            )
            self.job_description_label.show()
            for label in (self.job_meta_label, self.job_link_label):
                label.hide()
            return
        self.job_name_label.setText(breakable(about.name))
        # The step is here as well as in the sentence: it stays in view between tiles.
        meta = " · ".join(
            part
            for part in (
                f"Run by {about.operator}" if about.operator else "",
                about.size,
                progress_text(status),
            )
            if part
        )
        for label, text in (
            (self.job_description_label, about.description),
            (self.job_meta_label, meta),
            (self.job_link_label, about.link),
        ):
            label.setText(breakable(text))
            label.setVisible(bool(text))

    def _update_usage(self) -> None:
        # psutil reads /proc (or its equivalents): microseconds, fine on the GUI thread.
        cores = psutil.cpu_count() or 1
        cpu = self._process.cpu_percent(None) / cores
        text = f"CPU {cpu:.0f}%"
        if self.bridge.status.device == "cuda":
            text += f" · GPU {_gpu_use()}"
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


def _gpu_use() -> str:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return "n/a"
    try:
        return f"{torch.cuda.utilization()}%"  # needs pynvml
    except Exception:
        used = torch.cuda.memory_allocated() / 2**20
        return f"{used:.0f} MiB"
