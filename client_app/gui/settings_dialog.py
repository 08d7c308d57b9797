"""The settings dialog: every owner limit, applied live (no Apply button, no restart).

Each valid change emits ``settings_changed`` with a complete new ``WorkerSettings``;
whoever owns the worker applies it (the policy runner picks the in-use or idle limits)
and saves it. Invalid input (a malformed schedule) shows an inline error and emits
nothing, so the worker never sees settings that ``WorkerSettings`` would refuse. A
temperature limit that cannot apply here (no sensor) is greyed out, the reason beside it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import psutil
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSlider,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from client_app import autostart
from client_app.config import WorkerSettings
from client_app.policy import Schedule, Snooze, format_until

MIN_CPU_PERCENT = 10  # below this a tile's rest would outlast any coordinator deadline
MAX_BANDWIDTH_KBPS = 1_000_000  # ~1 GB/s: beyond any home link, so effectively a cap-free max
ERROR_STYLE = "color: #b00020;"
MIN_TEMP_C, MAX_TEMP_C = 20, 120  # what WorkerSettings accepts for a temperature limit


class SettingsDialog(QDialog):
    """Edits a ``WorkerSettings``; emits the whole new value on every valid change."""

    settings_changed = Signal(object)  # WorkerSettings

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        device_name: str,
        gpu_available: bool,
        cpu_temperature_missing: str = "",
        gpu_temperature_missing: str = "",
        parent: QWidget | None = None,
    ) -> None:
        """``*_temperature_missing``: why that temperature cannot be read here
        (``client_app.thermal.*_sensor_missing``); "" where a sensor exists."""
        super().__init__(parent)
        self.setWindowTitle("Cleave settings")
        self._settings = settings
        self._gpu_available = gpu_available
        self._cpu_temperature_missing = cpu_temperature_missing
        self._gpu_temperature_missing = gpu_temperature_missing
        # Injectable for tests: the clock for snooze, and what "start at login" runs.
        self.now: Callable[[], datetime] = datetime.now
        self.autostart_command: Callable[[], Sequence[str]] = autostart.app_command

        layout = QVBoxLayout(self)
        layout.addWidget(self._build_cpu_box())
        layout.addWidget(self._build_gpu_box(device_name))
        layout.addWidget(self._build_when_box())
        layout.addWidget(self._build_temperature_box())
        layout.addWidget(self._build_limits_box())
        layout.addWidget(self._build_pool_box())
        layout.addWidget(self._build_startup_box())
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self._sync_enabled()
        self._show_snooze()

    # ---- public ---------------------------------------------------------------------

    def settings(self) -> WorkerSettings:
        """The settings as they stand now (the last value emitted, or the initial one)."""
        return self._settings

    # ---- building -------------------------------------------------------------------

    def _build_cpu_box(self) -> QGroupBox:
        box = QGroupBox("Processor")
        form = QFormLayout(box)
        cores = os.cpu_count() or 1
        self.threads = QSpinBox()
        self.threads.setRange(1, cores)
        self.threads.setValue(min(self._settings.effective_threads, cores))
        self.threads.setToolTip(
            f"How many of this computer's {cores} processor threads Cleave may use at once. "
            "Fewer leaves more for your own programs."
        )
        self.threads.valueChanged.connect(lambda v: self._change(threads=v))

        percent = max(MIN_CPU_PERCENT, min(100, self._settings.cpu_percent))
        self.cpu_slider = QSlider(Qt.Orientation.Horizontal)
        self.cpu_slider.setRange(MIN_CPU_PERCENT, 100)
        self.cpu_slider.setValue(percent)
        self.cpu_percent = QSpinBox()
        self.cpu_percent.setRange(MIN_CPU_PERCENT, 100)
        self.cpu_percent.setSuffix(" %")
        self.cpu_percent.setValue(percent)
        tip = (
            "The share of time Cleave spends computing. At 50 % it rests as long as it "
            "worked after each piece of work, which keeps fans and temperatures down."
        )
        self.cpu_slider.setToolTip(tip)
        self.cpu_percent.setToolTip(tip)
        self.cpu_slider.setAccessibleName("CPU time while idle")
        # Slider and spin box mirror each other; only the spin box emits.
        self.cpu_slider.valueChanged.connect(self.cpu_percent.setValue)
        self.cpu_percent.valueChanged.connect(self.cpu_slider.setValue)
        self.cpu_percent.valueChanged.connect(lambda v: self._change(cpu_percent=v))
        row = QHBoxLayout()
        row.addWidget(self.cpu_slider, 1)
        row.addWidget(self.cpu_percent)
        row.addWidget(QLabel("threads"))
        row.addWidget(self.threads)
        form.addRow("When the computer is idle: CPU time", row)

        s = self._settings
        self.in_use_cpu_percent = QSpinBox()
        self.in_use_cpu_percent.setRange(0, 100)
        self.in_use_cpu_percent.setSingleStep(10)
        self.in_use_cpu_percent.setSuffix(" %")
        self.in_use_cpu_percent.setSpecialValueText("Pause")  # shown for 0
        # Typing "5" on the way to "50" must not emit 5 %; the value counts once the
        # field is left or Enter is pressed (the arrows still count at once).
        self.in_use_cpu_percent.setKeyboardTracking(False)
        self.in_use_cpu_percent.setValue(s.in_use_cpu_percent)
        self.in_use_cpu_percent.setToolTip(
            "The share of time Cleave computes while you use the computer, never more "
            "than when it is idle. 0: pause while you use it. Between 1 and "
            f"{MIN_CPU_PERCENT - 1} % counts as {MIN_CPU_PERCENT} %: less would leave a "
            "piece of work unfinished for too long."
        )
        self.in_use_cpu_percent.valueChanged.connect(self._on_in_use_cpu_percent)
        self.in_use_threads = QSpinBox()
        self.in_use_threads.setRange(0, cores)
        self.in_use_threads.setSpecialValueText("Same")  # shown for 0
        self.in_use_threads.setValue(min(s.in_use_threads, cores))
        self.in_use_threads.setToolTip(
            "How many processor threads Cleave may use while you use the computer, never "
            "more than when it is idle. Same: as many as when it is idle."
        )
        self.in_use_threads.valueChanged.connect(lambda v: self._change(in_use_threads=v))
        row = QHBoxLayout()
        row.addWidget(self.in_use_cpu_percent)
        row.addWidget(QLabel("threads"))
        row.addWidget(self.in_use_threads)
        row.addStretch(1)
        form.addRow("While I use the computer: CPU time", row)
        return box

    def _build_gpu_box(self, device_name: str) -> QGroupBox:
        box = QGroupBox("Graphics card")
        form = QFormLayout(box)
        if self._gpu_available:
            label = f"Use the graphics card ({device_name})"
            tip = "Compute on the graphics card, which is much faster than the processor."
        else:
            label = "Use the graphics card (none usable found)"
            tip = "No graphics card that Cleave can compute on was found in this computer."
        self.use_gpu = QCheckBox(label)
        self.use_gpu.setChecked(self._settings.use_gpu and self._gpu_available)
        self.use_gpu.setEnabled(self._gpu_available)
        self.use_gpu.setToolTip(tip)
        self.use_gpu.toggled.connect(lambda on: self._change(use_gpu=on))
        form.addRow(self.use_gpu)

        self.gpu_only_when_free = QCheckBox("Only while no other program is using it")
        self.gpu_only_when_free.setChecked(self._settings.gpu_only_when_free)
        self.gpu_only_when_free.setToolTip(
            "Step aside while a game or another program works on the graphics card. "
            "Needs the card maker's monitoring library (NVIDIA's NVML); without it "
            "Cleave cannot tell and uses the card."
        )
        self.gpu_only_when_free.toggled.connect(lambda on: self._change(gpu_only_when_free=on))
        form.addRow(self.gpu_only_when_free)
        return box

    def _build_when_box(self) -> QGroupBox:
        box = QGroupBox("When to compute")
        form = QFormLayout(box)
        s = self._settings
        self.idle_only = QCheckBox("Only while I am not using the computer")
        self.idle_only.setChecked(s.idle_only)
        self.idle_only.setToolTip(
            "Wait until your own programs have been quiet for a while (and, where the "
            "system tells, nobody touched the keyboard or mouse), and stop when they wake."
        )
        self.idle_only.toggled.connect(lambda on: self._change(idle_only=on))
        form.addRow(self.idle_only)

        self.idle_threshold = QSpinBox()
        self.idle_threshold.setRange(0, 100)
        self.idle_threshold.setSuffix(" %")
        self.idle_threshold.setValue(round(s.idle_threshold_percent))
        self.idle_threshold.setToolTip(
            "Other programs using less than this share of the processor count as idle."
        )
        self.idle_threshold.valueChanged.connect(
            lambda v: self._change(idle_threshold_percent=float(v))
        )
        self.idle_minutes = QDoubleSpinBox()
        self.idle_minutes.setRange(0.5, 24 * 60)
        self.idle_minutes.setDecimals(1)
        self.idle_minutes.setSuffix(" min")
        self.idle_minutes.setValue(s.idle_minutes)
        self.idle_minutes.setToolTip("... for at least this long before Cleave starts.")
        self.idle_minutes.valueChanged.connect(lambda v: self._change(idle_minutes=float(v)))
        row = QHBoxLayout()
        row.addWidget(QLabel("other programs below"))
        row.addWidget(self.idle_threshold)
        row.addWidget(QLabel("CPU for"))
        row.addWidget(self.idle_minutes)
        row.addStretch(1)
        form.addRow("Idle means:", row)

        self.pause_on_battery = QCheckBox("Pause while on battery")
        self.pause_on_battery.setChecked(s.pause_on_battery)
        self.pause_on_battery.setToolTip(
            "On a laptop, compute only while it is plugged in, so Cleave never drains it."
        )
        self.pause_on_battery.toggled.connect(lambda on: self._change(pause_on_battery=on))
        form.addRow(self.pause_on_battery)

        self.schedule = QLineEdit(s.schedule)
        self.schedule.setPlaceholderText("any time, e.g. 22:00-07:00, 12:00-13:00")
        self.schedule.setToolTip(
            "Daily hours when Cleave may compute, as start-end pairs separated by commas. "
            "A window may cross midnight. Empty: any time."
        )
        self.schedule.textChanged.connect(self._on_schedule)
        self.schedule_error = QLabel()
        self.schedule_error.setStyleSheet(ERROR_STYLE)
        self.schedule_error.setWordWrap(True)
        self.schedule_error.hide()
        form.addRow("Schedule:", self.schedule)
        form.addRow("", self.schedule_error)

        self.snooze_label = QLabel()
        self.snooze_hour = QPushButton("1 hour")
        self.snooze_hour.setToolTip("Pause all computing for the next hour.")
        self.snooze_hour.clicked.connect(self._snooze_hour)
        self.snooze_tomorrow = QPushButton("Until tomorrow")
        self.snooze_tomorrow.setToolTip("Pause all computing until midnight.")
        self.snooze_tomorrow.clicked.connect(self._snooze_tomorrow)
        self.snooze_cancel = QPushButton("Resume now")
        self.snooze_cancel.setToolTip("End the snooze; the other rules still apply.")
        self.snooze_cancel.clicked.connect(lambda: self._set_snooze(Snooze()))
        row = QHBoxLayout()
        row.addWidget(self.snooze_hour)
        row.addWidget(self.snooze_tomorrow)
        row.addWidget(self.snooze_cancel)
        row.addWidget(self.snooze_label, 1)
        form.addRow("Snooze:", row)
        return box

    def _build_temperature_box(self) -> QGroupBox:
        box = QGroupBox("Temperature")
        form = QFormLayout(box)
        s = self._settings
        self.max_cpu_temp, self.cpu_temp_reason = self._temperature_field(
            "CPU", s.max_cpu_temp_c, self._cpu_temperature_missing, "max_cpu_temp_c"
        )
        self.max_gpu_temp, self.gpu_temp_reason = self._temperature_field(
            "GPU", s.max_gpu_temp_c, self._gpu_temperature_missing, "max_gpu_temp_c"
        )
        self.temp_hysteresis = QSpinBox()
        self.temp_hysteresis.setRange(1, 30)
        self.temp_hysteresis.setSuffix(" °C")
        self.temp_hysteresis.setValue(round(s.temp_hysteresis_c))
        self.temp_hysteresis.setToolTip(
            "After a pause for heat, compute again once the temperature is this far "
            "below the limit, so that Cleave does not switch on and off at the limit."
        )
        self.temp_hysteresis.valueChanged.connect(
            lambda v: self._change(temp_hysteresis_c=float(v))
        )
        row = QHBoxLayout()
        row.addWidget(QLabel("CPU"))
        row.addWidget(self.max_cpu_temp)
        row.addWidget(QLabel("GPU"))
        row.addWidget(self.max_gpu_temp)
        row.addWidget(QLabel("resume"))
        row.addWidget(self.temp_hysteresis)
        row.addWidget(QLabel("below"))
        row.addStretch(1)
        form.addRow("Pause above:", row)
        form.addRow("", self.cpu_temp_reason)
        form.addRow("", self.gpu_temp_reason)
        return box

    def _temperature_field(
        self, part: str, value: float, missing: str, field: str
    ) -> tuple[QSpinBox, QLabel]:
        """A limit in °C ("Off" for none) and the label saying why it is greyed out."""
        spin = QSpinBox()
        spin.setRange(MIN_TEMP_C - 1, MAX_TEMP_C)  # the minimum shows as "Off": 0, no limit
        spin.setSpecialValueText("Off")
        spin.setSuffix(" °C")
        spin.setKeyboardTracking(False)  # "9" on the way to "90" is no limit to apply
        spin.setValue(round(value) if value else MIN_TEMP_C - 1)
        spin.setAccessibleName(f"{part} temperature limit")
        reason = QLabel()
        reason.setWordWrap(True)
        reason.setEnabled(False)  # greyed, like the field it explains
        if missing:
            spin.setEnabled(False)
            spin.setToolTip(f"Not available: {missing}.")
            reason.setText(f"{part} limit not available: {missing}.")
        else:
            spin.setToolTip(
                f"Pause when the {part} is hotter than this; Off: no limit. A cooler "
                "machine is quieter and lasts longer."
            )
            reason.hide()

        def changed(v: int) -> None:
            self._change(**{field: 0.0 if v < MIN_TEMP_C else float(v)})

        spin.valueChanged.connect(changed)
        return spin, reason

    def _build_limits_box(self) -> QGroupBox:
        box = QGroupBox("Limits")
        form = QFormLayout(box)
        ram_mb = max(1, psutil.virtual_memory().total >> 20)
        self.memory_mb = QSpinBox()
        self.memory_mb.setRange(0, ram_mb)
        self.memory_mb.setSingleStep(128)
        self.memory_mb.setSuffix(" MB")
        self.memory_mb.setSpecialValueText("Automatic")  # shown for 0
        self.memory_mb.setValue(min(self._settings.memory_mb, ram_mb))
        self.memory_mb.setToolTip(
            "The most memory one piece of work may take. Automatic: up to 1 GB, and never "
            "more than a quarter of this computer's memory. Applies from the next join."
        )
        self.memory_mb.valueChanged.connect(lambda v: self._change(memory_mb=v))
        form.addRow("Memory for tiles:", self.memory_mb)

        self.bandwidth_kbps = QSpinBox()
        self.bandwidth_kbps.setRange(0, MAX_BANDWIDTH_KBPS)
        self.bandwidth_kbps.setSingleStep(100)
        self.bandwidth_kbps.setSuffix(" KB/s")
        self.bandwidth_kbps.setSpecialValueText("Unlimited")  # shown for 0
        self.bandwidth_kbps.setValue(min(self._settings.bandwidth_kbps, MAX_BANDWIDTH_KBPS))
        self.bandwidth_kbps.setToolTip(
            "The most network traffic Cleave may use in each direction, so your own "
            "downloads and calls stay fast. 0: no limit."
        )
        self.bandwidth_kbps.valueChanged.connect(lambda v: self._change(bandwidth_kbps=v))
        form.addRow("Bandwidth limit:", self.bandwidth_kbps)
        return box

    def _build_pool_box(self) -> QGroupBox:
        box = QGroupBox("Private pool")
        form = QFormLayout(box)
        self.join_token = QLineEdit(self._settings.join_token)
        self.join_token.setEchoMode(QLineEdit.EchoMode.Password)
        self.join_token.setPlaceholderText("Only if the coordinator's operator gave you one")
        self.join_token.setToolTip(
            "The join token of a private pool. It never leaves this computer: the app "
            "only proves that it knows it. Applies from the next join."
        )
        self.join_token.textChanged.connect(lambda t: self._change(join_token=t.strip()))
        form.addRow("Join token:", self.join_token)
        return box

    def _build_startup_box(self) -> QGroupBox:
        box = QGroupBox("Start-up")
        form = QFormLayout(box)
        self.start_at_login = QCheckBox("Start Cleave when I log in")
        self.start_at_login.setChecked(self._settings.start_at_login)
        self.start_at_login.setToolTip(
            "Start Cleave in the tray each time you log in to this computer."
        )
        self.start_at_login.toggled.connect(self._on_start_at_login)
        self.autostart_error = QLabel()
        self.autostart_error.setStyleSheet(ERROR_STYLE)
        self.autostart_error.setWordWrap(True)
        self.autostart_error.hide()
        form.addRow(self.start_at_login)
        form.addRow(self.autostart_error)

        self.start_minimized = QCheckBox("Start minimised in the tray")
        self.start_minimized.setChecked(self._settings.start_minimized)
        self.start_minimized.setToolTip(
            "Open only the tray icon, not this window, when Cleave starts."
        )
        self.start_minimized.toggled.connect(lambda on: self._change(start_minimized=on))
        form.addRow(self.start_minimized)
        return box

    # ---- reacting -------------------------------------------------------------------

    def _change(self, **changes: Any) -> bool:
        """Apply ``changes`` and emit; False (and nothing emitted) if they are invalid."""
        try:
            new = dataclasses.replace(self._settings, **changes)
        except ValueError:
            return False  # the widgets' ranges make this rare; the old value stands
        if new == self._settings:
            return True
        self._settings = new
        self._sync_enabled()
        self.settings_changed.emit(new)
        return True

    def _sync_enabled(self) -> None:
        s = self._settings
        self.gpu_only_when_free.setEnabled(self._gpu_available and s.use_gpu)
        # "Idle" matters to computing only while idle and to in-use limits of their own.
        idle_matters = s.idle_only or s.in_use_cpu_percent < 100 or s.in_use_threads > 0
        self.idle_threshold.setEnabled(idle_matters)
        self.idle_minutes.setEnabled(idle_matters)
        # Computing only while idle leaves nothing for the in-use limits to govern.
        self.in_use_cpu_percent.setEnabled(not s.idle_only)
        self.in_use_threads.setEnabled(not s.idle_only and s.in_use_cpu_percent > 0)
        limited = (s.max_cpu_temp_c and not self._cpu_temperature_missing) or (
            s.max_gpu_temp_c and not self._gpu_temperature_missing
        )
        self.temp_hysteresis.setEnabled(bool(limited))

    def _on_in_use_cpu_percent(self, value: int) -> None:
        if 0 < value < MIN_CPU_PERCENT:
            self.in_use_cpu_percent.setValue(MIN_CPU_PERCENT)  # emits again, with 10
            return
        self._change(in_use_cpu_percent=value)

    def _on_schedule(self, text: str) -> None:
        try:
            Schedule.parse(text)
        except ValueError as exc:
            self.schedule_error.setText(str(exc))
            self.schedule_error.show()
            return
        self.schedule_error.hide()
        self._change(schedule=text.strip())

    def _snooze_hour(self) -> None:
        self._set_snooze(Snooze.for_duration(self.now()))

    def _snooze_tomorrow(self) -> None:
        self._set_snooze(Snooze.until_tomorrow(self.now()))

    def _set_snooze(self, snooze: Snooze) -> None:
        self._change(snooze_until=snooze.to_iso())
        self._show_snooze()

    def _show_snooze(self) -> None:
        try:
            snooze = Snooze.from_iso(self._settings.snooze_until)
        except ValueError:
            snooze = Snooze()
        now = self.now()
        active = snooze.active(now)
        if active and snooze.until is not None:
            self.snooze_label.setText(f"Snoozed until {format_until(snooze.until, now)}")
        else:
            self.snooze_label.setText("Not snoozed")
        self.snooze_cancel.setEnabled(active)

    def _on_start_at_login(self, on: bool) -> None:
        try:
            if on:
                autostart.enable(self.autostart_command())
            else:
                autostart.disable()
        except OSError as exc:
            self.autostart_error.setText(f"Could not change the login item: {exc}")
            self.autostart_error.show()
            # Show the truth: the entry did not change, so neither does the box.
            self.start_at_login.blockSignals(True)
            self.start_at_login.setChecked(not on)
            self.start_at_login.blockSignals(False)
            return
        self.autostart_error.hide()
        self._change(start_at_login=on)
