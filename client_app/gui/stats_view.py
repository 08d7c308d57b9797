"""Contribution statistics: this session and all time side by side, plus two charts.

A thin view over ``client_app.history.History``: every status update is recorded
there and the labels re-read from it; the charts are refreshed at most once a second
(they move per minute) and on a slow timer, so an idle hour still scrolls by.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QGridLayout, QLabel, QVBoxLayout, QWidget

from client_app.gui.charts import DailyChart, ThroughputChart
from client_app.gui.units import format_bytes, format_duration, format_gflop
from client_app.history import History, Totals
from client_app.status import WorkerStatus

DAYS_SHOWN = 14
CHART_REFRESH_MIN_S = 1.0
IDLE_REFRESH_MS = 15_000

# Row key, label, tooltip. Keys are what values() reports, as "<key>.session"/".all_time".
ROWS: tuple[tuple[str, str, str], ...] = (
    ("tiles", "Tiles computed", "Tiles this computer finished and sent back."),
    (
        "credit",
        "Verified credit",
        "From the coordinator's ledger: tiles (and their GFLOP) that the coordinator "
        "checked and accepted. It can trail tiles computed by a few seconds.",
    ),
    ("compute", "Time computing", "Time spent multiplying matrices for the coordinator."),
    ("received", "Data received", "Everything downloaded from the coordinator."),
    ("sent", "Data sent", "Everything uploaded to the coordinator."),
)


def format_credit(tiles: int, gflop: float) -> str:
    return f"{tiles:,} tiles ({format_gflop(gflop)})"


def row_texts(t: Totals) -> dict[str, str]:
    """What each row shows for one column."""
    return {
        "tiles": f"{t.tiles:,}",
        "credit": format_credit(t.credit_tiles, t.credit_gflop),
        "compute": format_duration(t.compute_s),
        "received": format_bytes(t.bytes_in),
        "sent": format_bytes(t.bytes_out),
    }


class StatsView(QWidget):
    """Session and all-time figures, throughput over the last hour, GFLOP per day."""

    def __init__(
        self,
        history: History,
        parent: QWidget | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(parent)
        self.history = history
        self._clock = clock
        self._charts_at: float | None = None

        grid = QGridLayout()
        grid.setHorizontalSpacing(16)
        grid.setVerticalSpacing(2)
        for col, heading in ((1, "This session"), (2, "All time")):
            label = QLabel(f"<b>{heading}</b>")
            grid.addWidget(label, 0, col, Qt.AlignmentFlag.AlignRight)
        self.labels: dict[str, QLabel] = {}
        for row, (key, text, tip) in enumerate(ROWS, start=1):
            name = QLabel(text)
            name.setToolTip(tip)
            grid.addWidget(name, row, 0)
            for col, span in ((1, "session"), (2, "all_time")):
                value = QLabel()
                value.setToolTip(tip)
                value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
                grid.addWidget(value, row, col, Qt.AlignmentFlag.AlignRight)
                self.labels[f"{key}.{span}"] = value
        grid.setColumnStretch(0, 1)

        note = QLabel("Verified credit comes from the coordinator's ledger.")
        note.setEnabled(False)  # greyed: a footnote, not a figure
        note.setWordWrap(True)

        self.throughput_chart = ThroughputChart(self)
        self.daily_chart = DailyChart(self)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(grid)
        layout.addWidget(note)
        layout.addWidget(self.throughput_chart, 1)
        layout.addWidget(self.daily_chart, 1)

        # Status updates stop while idle, but the last hour keeps moving.
        self._timer = QTimer(self)
        self._timer.setInterval(IDLE_REFRESH_MS)
        self._timer.timeout.connect(self.refresh)
        self._timer.start()
        self.refresh()

    def update_status(self, status: WorkerStatus) -> None:
        """Record one status into the history and show the new figures."""
        now = self._clock()
        self.history.record(status, now)
        self._refresh_labels()
        # Charts change per minute; repainting them on every update would waste CPU.
        if self._charts_at is None or abs(now - self._charts_at) >= CHART_REFRESH_MIN_S:
            self._refresh_charts(now)

    def refresh(self) -> None:
        """Re-read everything from the history (the idle timer calls this)."""
        now = self._clock()
        # Records flush only when the next one comes; when the worker goes quiet, this
        # timer writes the last few seconds so a crash while idle loses nothing.
        self.history.flush(now)
        self._refresh_labels()
        self._refresh_charts(now)

    def values(self) -> dict[str, str]:
        """What the labels show, keyed ``"tiles.session"``, ``"credit.all_time"``, ..."""
        return {key: label.text() for key, label in self.labels.items()}

    def _refresh_labels(self) -> None:
        for span, totals in (
            ("session", self.history.session()),
            ("all_time", self.history.all_time()),
        ):
            for key, text in row_texts(totals).items():
                self.labels[f"{key}.{span}"].setText(text)

    def _refresh_charts(self, now: float) -> None:
        self._charts_at = now
        self.throughput_chart.set_points(self.history.throughput_last_hour(now))
        self.daily_chart.set_days(self.history.per_day(DAYS_SHOWN, now))
