"""Render the app's main window, stats view and settings dialog into docs/*.png.

Offscreen, with a throwaway config directory and made-up figures, so it needs no
display, no coordinator and never touches the user's settings:

    python docs/screenshots.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # run from a checkout without installing

from PySide6.QtWidgets import QApplication, QWidget  # noqa: E402

from client_app.config import WorkerSettings  # noqa: E402
from client_app.status import WorkerStatus  # noqa: E402
from client_app.thermal import cpu_sensor_missing, gpu_sensor_missing  # noqa: E402

URL = "ws://coordinator.example.org:8765/ws"
FINGERPRINT = "3f9a-c1e2-77b0-94d5-0a6e-51b8-d2f4-8c03"
# What a coordinator says about its job (common.job_about.JobAbout).
JOB = {
    "job_name": "tiny_gpt",
    "job_description": (
        "A small GPT-style language model learning to write like Shakespeare's sonnets. "
        "It shows how volunteers' computers can train a model together: each piece of "
        "work is one matrix product of a training step."
    ),
    "job_operator": "Cleave demo coordinator",
    "job_link": "https://example.org/cleave/tiny-gpt",
    "job_parameters": 420_000,
    "job_steps": 5_000,
}


def sample_statuses(now: float) -> list[tuple[float, WorkerStatus]]:
    """An hour of work: a tile every ~20 s, the coordinator's credit trailing behind."""
    out = []
    gflop = 0.0
    for i in range(1, 181):
        gflop += 310.0 * (1.25 if (i // 30) % 2 else 0.8)  # the owner's use comes and goes
        out.append(
            (
                now - 3600 + i * 20,
                WorkerStatus(
                    state="computing",
                    line=f"Computing tile t-{i}",
                    coordinator_url=URL,
                    coordinator_fingerprint=FINGERPRINT,
                    worker_id="w7",
                    current_tile=f"t-{i}",
                    tiles_done=i,
                    compute_s=i * 6.5,
                    gflop_done=gflop,
                    bytes_in=i * 24 << 20,
                    bytes_out=i * 8 << 20,
                    credit_tiles=max(0, i - 3),
                    credit_gflop=max(0, i - 3) * 300.0,
                    threads=4,
                    device="cpu",
                    cpu_percent=70,
                    limits_mode="idle",
                    job_step=1_024 + i,  # step 1,204 of 5,000 at the end
                    **JOB,  # type: ignore[arg-type]
                ),
            )
        )
    return out


def save(widget: QWidget, name: str) -> Path:
    widget.show()
    QApplication.processEvents()
    path = DOCS / name
    if not widget.grab().save(str(path)):
        raise SystemExit(f"could not write {path}")
    print(f"wrote {path}")
    return path


def main() -> int:
    config = Path(tempfile.mkdtemp(prefix="cleave-screens-"))
    os.environ["CLEAVE_CONFIG_DIR"] = str(config)
    app = QApplication(sys.argv[:1])
    # Imported after QApplication and the config override: the window reads both.
    from client_app.gui.main_window import MainWindow, SettingsDialog

    settings = WorkerSettings(coordinator_url=URL, name="studio-pc", threads=4, cpu_percent=70)
    statuses = sample_statuses(time.time())
    window = MainWindow(settings, config)
    # Fed through the window's own history, as an hour of statuses would have been; the
    # last one shown again adds nothing (the history counts differences).
    if window.history is not None:
        for t, status in statuses:
            window.history.record(status, t)
    window.show_status(statuses[-1][1])
    if window.stats_view is not None:
        window.stats_view.refresh()  # type: ignore[attr-defined]
    window.join_button.setText("&Leave")  # what a joined window shows
    window.usage_label.setText("CPU 48%")
    em = window.fontMetrics().height()
    window.resize(44 * em, 74 * em)  # tall enough to show the charts without scrolling
    save(window, "main_window.png")

    if window.stats_view is not None:
        window.stats_view.resize(560, 480)
        save(window.stats_view, "stats_view.png")
    else:
        print("stats view not importable: skipped", file=sys.stderr)
    if SettingsDialog is not None:
        # As on a desktop without lm-sensors: the CPU limit shows why it is greyed out.
        dialog = SettingsDialog(
            settings,
            device_name="AMD Ryzen 7 5800X",
            gpu_available=False,
            cpu_temperature_missing=cpu_sensor_missing(None, platform="linux"),
            gpu_temperature_missing=gpu_sensor_missing(None, gpu_present=False),
        )
        save(dialog, "settings_dialog.png")
    else:
        print("settings dialog not importable: skipped", file=sys.stderr)
    window.shutdown()
    app.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
