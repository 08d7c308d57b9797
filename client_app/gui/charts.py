"""Two small custom-painted charts (PySide6-Essentials has no QtCharts).

Both take plain lists from ``client_app.history`` and paint with the widget's palette,
so they follow light and dark themes. With no data they still draw their axes, plus a
line of text saying why the chart is empty, rather than an unexplained blank box.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import date
from typing import Protocol

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFontMetricsF, QPainter, QPainterPath, QPaintEvent, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

Y_TICKS = 4


def nice_axis(max_value: float, ticks: int = Y_TICKS) -> tuple[float, float]:
    """A round axis top and step (1, 2, 2.5 or 5 times a power of ten) covering max_value."""
    if not math.isfinite(max_value) or max_value <= 0:
        return 1.0, 1.0 / ticks
    raw = max_value / ticks
    power = 10.0 ** math.floor(math.log10(raw))
    for mult in (1.0, 2.0, 2.5, 5.0, 10.0):
        step = mult * power
        if step * ticks >= max_value * (1 - 1e-12):
            return step * ticks, step
    return 10.0 * power * ticks, 10.0 * power  # unreachable: mult 10 always covers


def compact_number(value: float) -> str:
    """Axis-label numbers: 0, 0.25, 2.5, 40, 1.2k, 3M."""
    if value == 0:
        return "0"
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


class _Series(Protocol):
    """What a chart paints: each concrete chart supplies these for its own data."""

    def is_empty(self) -> bool: ...

    def max_value(self) -> float: ...

    def x_labels(self) -> list[tuple[float, str]]:
        """(fraction 0..1 along the x axis, text) pairs."""
        ...

    def paint_series(self, p: QPainter, plot: QRectF, top: float, colour: QColor) -> None: ...


class _Chart(QWidget):
    """Frame, title, y grid and empty-state text; ``series`` paints the data."""

    def __init__(
        self, title: str, empty_text: str, series: _Series, parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self._title = title
        self._empty_text = empty_text
        self._series = series
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setMinimumSize(160, 90)

    def sizeHint(self) -> QSize:
        return QSize(480, 150)

    def title(self) -> str:
        return self._title

    def paintEvent(self, event: QPaintEvent) -> None:  # noqa: N802 - Qt's name
        p = QPainter(self)
        try:
            p.setRenderHint(QPainter.RenderHint.Antialiasing)
            self._paint(p)
        finally:
            p.end()

    def _paint(self, p: QPainter) -> None:
        pal = self.palette()
        text = pal.color(QPalette.ColorRole.WindowText)
        faint = QColor(text)
        faint.setAlphaF(0.6)
        grid = QColor(text)
        grid.setAlphaF(0.15)
        series = pal.color(QPalette.ColorRole.Highlight)
        fm = QFontMetricsF(self.font())
        line_h = fm.height()

        bounds = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        p.setPen(QPen(grid, 1))
        p.setBrush(pal.color(QPalette.ColorRole.Base))
        p.drawRoundedRect(bounds, 4, 4)

        pad = 6.0
        p.setPen(text)
        title_rect = QRectF(pad, pad / 2, bounds.width() - 2 * pad, line_h)
        p.drawText(
            title_rect,
            Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
            fm.elidedText(self._title, Qt.TextElideMode.ElideRight, title_rect.width()),
        )

        top, step = nice_axis(self._series.max_value())
        y_labels = [compact_number(step * i) for i in range(Y_TICKS + 1)]
        label_w = max(fm.horizontalAdvance(s) for s in y_labels) + 4
        plot = QRectF(
            pad + label_w,
            pad / 2 + line_h + line_h / 2,
            bounds.width() - 2 * pad - label_w - fm.horizontalAdvance("0") / 2,
            bounds.height() - pad - 2 * line_h - line_h / 2,
        )
        if plot.width() < 10 or plot.height() < 10:
            return  # too small to say anything useful; the title is enough

        # Horizontal grid with value labels.
        p.setFont(self.font())
        for i, label in enumerate(y_labels):
            y = plot.bottom() - plot.height() * i / Y_TICKS
            p.setPen(QPen(grid, 1))
            p.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
            p.setPen(faint)
            p.drawText(
                QRectF(pad, y - line_h / 2, label_w - 4, line_h),
                Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                label,
            )

        # X labels in priority order; one that would overlap a placed one is skipped,
        # so narrow charts show fewer labels instead of a smudge.
        placed: list[tuple[float, float]] = []
        for frac, label in self._series.x_labels():
            w = fm.horizontalAdvance(label)
            x = plot.left() + plot.width() * frac
            left = min(max(x - w / 2, plot.left() - label_w), plot.right() - w + 2)
            if any(left < r + 8 and left + w + 8 > lo for lo, r in placed):
                continue
            p.drawText(
                QRectF(left, plot.bottom() + 2, w + 1, line_h),
                Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop,
                label,
            )
            placed.append((left, left + w))

        if self._series.is_empty():
            p.setPen(faint)
            p.drawText(
                plot, Qt.AlignmentFlag.AlignCenter | Qt.TextFlag.TextWordWrap, self._empty_text
            )
            return
        p.save()
        p.setClipRect(plot.adjusted(-1, -1, 1, 1))
        self._series.paint_series(p, plot, top, series)
        p.restore()


class ThroughputChart(_Chart):
    """An area chart of GFLOP/s over the last hour, one point per minute."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(
            "Throughput, last hour (GFLOP/s, per-minute average)",
            "No tiles computed in the last hour",
            self,
            parent,
        )
        self._rates: list[float] = []

    def set_points(self, points: Sequence[tuple[float, float]]) -> None:
        """``(minute_start, gflop in that minute)`` pairs, oldest first."""
        self._rates = [max(0.0, gflop) / 60.0 for _, gflop in points]
        self.update()

    def rates(self) -> list[float]:
        return list(self._rates)

    def is_empty(self) -> bool:
        return not any(self._rates)

    def max_value(self) -> float:
        return max(self._rates, default=0.0)

    def x_labels(self) -> list[tuple[float, str]]:
        return [(0.0, "60 min ago"), (0.25, "45"), (0.5, "30"), (0.75, "15"), (1.0, "now")]

    def paint_series(self, p: QPainter, plot: QRectF, top: float, colour: QColor) -> None:
        n = len(self._rates)
        if n < 2:
            return
        points = [
            QPointF(
                plot.left() + plot.width() * i / (n - 1),
                plot.bottom() - plot.height() * min(r / top, 1.0),
            )
            for i, r in enumerate(self._rates)
        ]
        line = QPainterPath(points[0])
        for pt in points[1:]:
            line.lineTo(pt)
        area = QPainterPath(line)
        area.lineTo(plot.right(), plot.bottom())
        area.lineTo(plot.left(), plot.bottom())
        area.closeSubpath()
        fill = QColor(colour)
        fill.setAlphaF(0.3)
        p.fillPath(area, fill)
        p.setPen(QPen(colour, 1.6))
        p.setBrush(Qt.BrushStyle.NoBrush)
        p.drawPath(line)


class DailyChart(_Chart):
    """A bar chart of GFLOP contributed per local day."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(
            "Contribution per day (GFLOP)", "No contribution in these days yet", self, parent
        )
        self._days: list[tuple[date, float, int]] = []

    def set_days(self, days: Sequence[tuple[date, float, int]]) -> None:
        """``(date, gflop, tiles)`` rows, oldest first."""
        self._days = list(days)
        self.update()

    def days(self) -> list[tuple[date, float, int]]:
        return list(self._days)

    def is_empty(self) -> bool:
        return not any(g > 0 for _, g, _ in self._days)

    def max_value(self) -> float:
        return max((g for _, g, _ in self._days), default=0.0)

    def x_labels(self) -> list[tuple[float, str]]:
        n = len(self._days)
        if n == 0:
            return []
        labels = [((i + 0.5) / n, f"{d:%b} {d.day}") for i, (d, _, _) in enumerate(self._days)]
        # Today first, then back in steps of 2, then the rest: when space is short the
        # labels that survive are evenly spaced and the newest is always among them.
        newest_first = labels[::-1]
        return newest_first[::2] + newest_first[1::2]

    def paint_series(self, p: QPainter, plot: QRectF, top: float, colour: QColor) -> None:
        n = len(self._days)
        if n == 0:
            return
        slot = plot.width() / n
        gap = min(slot * 0.25, 6.0)
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(colour)
        for i, (_, gflop, _) in enumerate(self._days):
            h = plot.height() * min(max(gflop, 0.0) / top, 1.0)
            if h <= 0:
                continue
            p.drawRect(QRectF(plot.left() + i * slot + gap / 2, plot.bottom() - h, slot - gap, h))
