"""The settings dialog (pytest-qt, offscreen): every control emits complete new settings."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("PySide6")

from pytestqt.qtbot import QtBot  # noqa: E402

from client_app.config import WorkerSettings  # noqa: E402
from client_app.gui.settings_dialog import SettingsDialog  # noqa: E402

NOW = datetime(2024, 5, 3, 14, 30)
BASE = WorkerSettings(threads=1, cpu_percent=100, use_gpu=True)


def make(
    qtbot: QtBot,
    settings: WorkerSettings = BASE,
    gpu: bool = True,
    cpu_missing: str = "",
    gpu_missing: str = "",
) -> SettingsDialog:
    dialog = SettingsDialog(
        settings,
        device_name="Test GPU 9000",
        gpu_available=gpu,
        cpu_temperature_missing=cpu_missing,
        gpu_temperature_missing=gpu_missing,
    )
    qtbot.addWidget(dialog)
    dialog.now = lambda: NOW
    return dialog


def emitted(qtbot: QtBot, dialog: SettingsDialog, action: Any) -> WorkerSettings:
    with qtbot.waitSignal(dialog.settings_changed, timeout=1000) as blocker:
        action()
    new = blocker.args[0]
    assert isinstance(new, WorkerSettings) and dialog.settings() == new
    return new


def test_every_control_changes_the_emitted_settings(qtbot: QtBot) -> None:
    d = make(qtbot)
    if d.threads.maximum() > 1:
        assert emitted(qtbot, d, lambda: d.threads.setValue(2)).threads == 2
    assert emitted(qtbot, d, lambda: d.cpu_percent.setValue(40)).cpu_percent == 40
    assert d.cpu_slider.value() == 40
    assert emitted(qtbot, d, lambda: d.cpu_slider.setValue(70)).cpu_percent == 70
    assert (
        emitted(qtbot, d, lambda: d.gpu_only_when_free.setChecked(False)).gpu_only_when_free
        is False
    )
    assert emitted(qtbot, d, lambda: d.use_gpu.setChecked(False)).use_gpu is False
    assert not d.gpu_only_when_free.isEnabled()  # meaningless without the GPU

    assert not d.idle_threshold.isEnabled()
    assert emitted(qtbot, d, lambda: d.idle_only.setChecked(True)).idle_only is True
    assert d.idle_threshold.isEnabled() and d.idle_minutes.isEnabled()
    assert emitted(qtbot, d, lambda: d.idle_threshold.setValue(15)).idle_threshold_percent == 15.0
    assert emitted(qtbot, d, lambda: d.idle_minutes.setValue(2.5)).idle_minutes == 2.5
    assert emitted(qtbot, d, lambda: d.pause_on_battery.setChecked(False)).pause_on_battery is False
    assert emitted(qtbot, d, lambda: d.memory_mb.setValue(512)).memory_mb == 512
    assert emitted(qtbot, d, lambda: d.bandwidth_kbps.setValue(300)).bandwidth_kbps == 300
    new = emitted(qtbot, d, lambda: d.schedule.setText("22:00-07:00"))
    assert new.schedule == "22:00-07:00"
    assert emitted(qtbot, d, lambda: d.start_minimized.setChecked(True)).start_minimized is True
    assert emitted(qtbot, d, lambda: d.join_token.setText(" pool-7 ")).join_token == "pool-7"

    assert emitted(qtbot, d, lambda: d.max_cpu_temp.setValue(85)).max_cpu_temp_c == 85.0
    assert emitted(qtbot, d, lambda: d.max_gpu_temp.setValue(90)).max_gpu_temp_c == 90.0
    assert emitted(qtbot, d, lambda: d.temp_hysteresis.setValue(8)).temp_hysteresis_c == 8.0

    # Snooze: 1 hour, until tomorrow (midnight), cancel.
    assert emitted(qtbot, d, d.snooze_hour.click).snooze_until == "2024-05-03T15:30:00"
    assert d.snooze_label.text() == "Snoozed until 15:30" and d.snooze_cancel.isEnabled()
    assert emitted(qtbot, d, d.snooze_tomorrow.click).snooze_until == "2024-05-04T00:00:00"
    assert d.snooze_label.text() == "Snoozed until tomorrow 00:00"
    assert emitted(qtbot, d, d.snooze_cancel.click).snooze_until == ""
    assert d.snooze_label.text() == "Not snoozed" and not d.snooze_cancel.isEnabled()

    # Every change kept the others: the final value carries all of them.
    final = d.settings()
    assert (final.cpu_percent, final.memory_mb, final.bandwidth_kbps) == (70, 512, 300)
    assert final.idle_only and final.start_minimized and not final.use_gpu
    assert (final.max_cpu_temp_c, final.max_gpu_temp_c, final.temp_hysteresis_c) == (85, 90, 8)


def test_invalid_schedule_shows_an_error_and_emits_nothing(qtbot: QtBot) -> None:
    d = make(qtbot)
    d.show()
    seen: list[WorkerSettings] = []
    d.settings_changed.connect(seen.append)
    d.schedule.setText("25:00-07:00")
    assert seen == [] and d.settings().schedule == ""
    assert d.schedule_error.isVisible() and "25:00" in d.schedule_error.text()
    d.schedule.setText("")  # clearing it is valid again, but nothing changed
    assert not d.schedule_error.isVisible() and seen == []


def test_gpu_box_disabled_without_a_gpu(qtbot: QtBot) -> None:
    d = make(qtbot, gpu=False)
    assert not d.use_gpu.isEnabled() and not d.use_gpu.isChecked()
    assert not d.gpu_only_when_free.isEnabled()
    assert "Test GPU 9000" not in d.use_gpu.text()
    with_gpu = make(qtbot)
    assert with_gpu.use_gpu.isEnabled() and "Test GPU 9000" in with_gpu.use_gpu.text()


def test_start_at_login_writes_the_autostart_entry(
    qtbot: QtBot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    d = make(qtbot)
    d.autostart_command = lambda: ["/usr/bin/cleave-app"]
    entry = tmp_path / "xdg" / "autostart" / "cleave-app.desktop"
    assert emitted(qtbot, d, lambda: d.start_at_login.setChecked(True)).start_at_login is True
    assert "Exec=/usr/bin/cleave-app --minimized" in entry.read_text(encoding="utf-8")
    assert emitted(qtbot, d, lambda: d.start_at_login.setChecked(False)).start_at_login is False
    assert not entry.exists()


def test_a_failed_login_item_shows_why_and_keeps_the_box_truthful(
    qtbot: QtBot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocker))  # autostart/ cannot be made here
    d = make(qtbot)
    d.show()
    seen: list[WorkerSettings] = []
    d.settings_changed.connect(seen.append)
    d.start_at_login.setChecked(True)
    assert seen == [] and not d.start_at_login.isChecked()
    assert d.autostart_error.isVisible()


def test_initial_values_come_from_the_settings(qtbot: QtBot) -> None:
    s = WorkerSettings(
        cpu_percent=55,
        memory_mb=256,
        bandwidth_kbps=64,
        schedule="08:00-09:00",
        idle_only=True,
        start_at_login=True,
        start_minimized=True,
        snooze_until="2024-05-03T18:00:00",
        in_use_cpu_percent=30,
        in_use_threads=1,
        max_gpu_temp_c=75.0,
        temp_hysteresis_c=7.0,
    )
    d = make(qtbot, s)
    assert d.in_use_cpu_percent.value() == 30 and d.in_use_threads.value() == 1
    assert d.max_gpu_temp.value() == 75 and d.temp_hysteresis.value() == 7
    assert d.cpu_percent.value() == 55 and d.cpu_slider.value() == 55
    assert d.memory_mb.value() == 256 and d.bandwidth_kbps.value() == 64
    assert d.schedule.text() == "08:00-09:00" and d.idle_only.isChecked()
    assert d.start_at_login.isChecked() and d.start_minimized.isChecked()
    assert d.settings() == s


def test_in_use_limits_and_their_link_to_idle_only(qtbot: QtBot) -> None:
    d = make(qtbot)
    assert d.in_use_cpu_percent.isEnabled() and d.in_use_threads.isEnabled()
    assert not d.idle_threshold.isEnabled()  # no limits of their own: "idle" decides nothing
    assert emitted(qtbot, d, lambda: d.in_use_cpu_percent.setValue(30)).in_use_cpu_percent == 30
    # What "idle" means now decides which limits apply.
    assert d.idle_threshold.isEnabled() and d.idle_minutes.isEnabled()
    if d.in_use_threads.maximum() >= 1:
        assert emitted(qtbot, d, lambda: d.in_use_threads.setValue(1)).in_use_threads == 1
    assert emitted(qtbot, d, lambda: d.in_use_threads.setValue(0)).in_use_threads == 0
    assert d.in_use_threads.text() == "Same"
    # 0 % pauses while in use: the thread count has nothing left to govern.
    assert emitted(qtbot, d, lambda: d.in_use_cpu_percent.setValue(0)).in_use_cpu_percent == 0
    assert d.in_use_cpu_percent.text() == "Pause" and not d.in_use_threads.isEnabled()
    # Below the floor a rest would outlast a deadline: 5 % counts as 10 %.
    assert emitted(qtbot, d, lambda: d.in_use_cpu_percent.setValue(5)).in_use_cpu_percent == 10
    assert d.in_use_cpu_percent.value() == 10 and d.in_use_threads.isEnabled()
    # Computing only while idle leaves the in-use limits nothing to do.
    assert emitted(qtbot, d, lambda: d.idle_only.setChecked(True)).idle_only is True
    assert not d.in_use_cpu_percent.isEnabled() and not d.in_use_threads.isEnabled()
    assert emitted(qtbot, d, lambda: d.idle_only.setChecked(False)).idle_only is False
    assert d.in_use_cpu_percent.isEnabled()


def test_temperature_limits_off_and_on(qtbot: QtBot) -> None:
    d = make(qtbot, WorkerSettings(max_cpu_temp_c=80.0))
    d.show()
    assert d.max_cpu_temp.value() == 80 and d.max_gpu_temp.text() == "Off"
    assert d.temp_hysteresis.isEnabled()  # a limit is set
    assert not d.cpu_temp_reason.isVisible() and not d.gpu_temp_reason.isVisible()
    off = emitted(qtbot, d, lambda: d.max_cpu_temp.setValue(d.max_cpu_temp.minimum()))
    assert off.max_cpu_temp_c == 0.0 and d.max_cpu_temp.text() == "Off"
    assert not d.temp_hysteresis.isEnabled()  # no limit: nothing to resume below
    assert emitted(qtbot, d, lambda: d.max_cpu_temp.setValue(20)).max_cpu_temp_c == 20.0
    assert d.max_cpu_temp.maximum() == 120


def test_a_missing_sensor_greys_the_field_out_and_says_why(qtbot: QtBot) -> None:
    why_cpu = "no CPU temperature sensor found (on Linux: load the lm-sensors modules)"
    why_gpu = "no graphics card is used for tiles"
    d = make(qtbot, WorkerSettings(max_cpu_temp_c=85.0), cpu_missing=why_cpu, gpu_missing=why_gpu)
    d.show()
    for spin, label, why in (
        (d.max_cpu_temp, d.cpu_temp_reason, why_cpu),
        (d.max_gpu_temp, d.gpu_temp_reason, why_gpu),
    ):
        assert not spin.isEnabled()
        assert why in spin.toolTip()
        assert label.isVisible() and why in label.text()
    assert d.max_cpu_temp.value() == 85  # kept: it applies where a sensor exists
    assert not d.temp_hysteresis.isEnabled()  # no limit can apply here
    only_gpu = make(qtbot, gpu_missing=why_gpu)
    only_gpu.show()
    assert only_gpu.max_cpu_temp.isEnabled() and not only_gpu.cpu_temp_reason.isVisible()
    assert not only_gpu.max_gpu_temp.isEnabled() and only_gpu.gpu_temp_reason.isVisible()
