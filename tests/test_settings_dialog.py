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


def make(qtbot: QtBot, settings: WorkerSettings = BASE, gpu: bool = True) -> SettingsDialog:
    dialog = SettingsDialog(settings, device_name="Test GPU 9000", gpu_available=gpu)
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
    )
    d = make(qtbot, s)
    assert d.cpu_percent.value() == 55 and d.cpu_slider.value() == 55
    assert d.memory_mb.value() == 256 and d.bandwidth_kbps.value() == 64
    assert d.schedule.text() == "08:00-09:00" and d.idle_only.isChecked()
    assert d.start_at_login.isChecked() and d.start_minimized.isChecked()
    assert d.settings() == s
