"""The stats view shows what the history holds; the charts paint at any size, even empty."""

from __future__ import annotations

from datetime import date, datetime, timezone
from pathlib import Path

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtGui import QColor, QImage  # noqa: E402
from pytestqt.qtbot import QtBot  # noqa: E402
from support.statuses import st as status  # one status builder for both history tests

from client_app.gui.charts import DailyChart, ThroughputChart, compact_number, nice_axis  # noqa: E402
from client_app.gui.stats_view import (  # noqa: E402
    StatsView,
    format_bytes,
    format_duration,
    format_gflop,
)
from client_app.history import History  # noqa: E402

UTC = timezone.utc
T0 = datetime(2025, 3, 10, 12, 0, tzinfo=UTC).timestamp()


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def history(tmp_path: Path) -> History:
    h = History.open(tmp_path, tz=UTC)
    yield h  # type: ignore[misc]
    h.close()


def painted_colours(image: QImage) -> int:
    """How many distinct colours a rendering has: a blank widget has one or two."""
    seen: set[int] = set()
    for y in range(0, image.height(), 3):
        for x in range(0, image.width(), 3):
            seen.add(image.pixel(x, y))
    return len(seen)


def test_formatting_for_people() -> None:
    # Seconds until a minute is reached: 557 tiles of milliseconds must not read "0:00:00".
    assert format_duration(0) == "0 s"
    assert format_duration(0.004) == "< 0.01 s"
    assert format_duration(0.4) == "0.4 s"
    assert format_duration(0.047) == "0.04 s"  # rounded down: never more than was given
    assert format_duration(4.26) == "4.2 s"
    assert format_duration(9.99) == "9.9 s"
    assert format_duration(12.7) == "12 s"
    assert format_duration(59.9) == "59 s"
    assert format_duration(185) == "3 min 05 s"
    assert format_duration(3725.9) == "1 h 02 min"
    assert format_duration(27 * 3600 + 3 * 60 + 9) == "27 h 03 min"
    assert format_duration(-1) == "0 s" and format_duration(float("nan")) == "0 s"
    assert format_bytes(0) == "0 B"
    assert format_bytes(999) == "999 B"
    assert format_bytes(1_500) == "1.5 kB"
    assert format_bytes(123_456_789) == "123 MB"
    assert format_bytes(2_000_000_000) == "2 GB"
    assert format_gflop(0) == "0 GFLOP"
    assert format_gflop(12.345) == "12.3 GFLOP"
    assert format_gflop(2_500) == "2.5 TFLOP"
    assert nice_axis(0) == (1.0, 0.25)
    assert nice_axis(7.3) == (8.0, 2.0)
    assert nice_axis(9.5) == (10.0, 2.5)
    assert nice_axis(1234) == (2000.0, 500.0)
    assert compact_number(2500) == "2.5k" and compact_number(0.25) == "0.25"


def test_shows_session_and_all_time_figures(qtbot: QtBot, tmp_path: Path) -> None:
    # An earlier app run left some history behind.
    with History.open(tmp_path, tz=UTC) as earlier:
        earlier.record(status(10, 20.0, 60.0, 5_000_000, 1_000_000, 8, 16.0), T0 - 86400)
    history = History.open(tmp_path, tz=UTC)
    clock = Clock(T0)
    view = StatsView(history, clock=clock)
    qtbot.addWidget(view)
    assert view.values()["tiles.session"] == "0"
    assert view.values()["tiles.all_time"] == "10"

    view.update_status(status(3, 6.0, 3725.0, 2_500_000, 1_500))
    clock.t += 2
    view.update_status(status(5, 10.0, 3730.0, 3_000_000, 2_000, 12, 24.5))
    v = view.values()
    assert v["tiles.session"] == "5"
    assert v["tiles.all_time"] == "15"
    assert v["compute.session"] == "1 h 02 min"
    assert v["compute.all_time"] == "1 h 03 min"
    assert v["received.session"] == "3 MB"
    assert v["received.all_time"] == "8 MB"
    assert v["sent.session"] == "2 kB"
    assert v["sent.all_time"] == "1 MB"
    # Credit is the coordinator's ledger figure, not the tiles we counted ourselves.
    assert v["credit.all_time"] == "12 tiles (24.5 GFLOP)"
    assert v["credit.session"] == "4 tiles (8.5 GFLOP)"
    # The charts got the same history.
    assert view.throughput_chart.rates()[-1] == pytest.approx(10.0 / 60)
    assert view.daily_chart.days()[-1] == (date(2025, 3, 10), 10.0, 5)
    assert view.daily_chart.days()[-2] == (date(2025, 3, 9), 20.0, 10)
    history.close()


def test_charts_refresh_on_idle_timer_not_every_update(qtbot: QtBot, history: History) -> None:
    clock = Clock(T0)
    view = StatsView(history, clock=clock)
    qtbot.addWidget(view)
    clock.t += 1  # a second after the view first drew its charts
    view.update_status(status(1, 60.0, 1.0, 10, 10))
    clock.t += 0.1
    view.update_status(status(2, 120.0, 2.0, 20, 20))  # within a second: labels only
    assert view.values()["tiles.session"] == "2"
    assert view.throughput_chart.rates()[-1] == pytest.approx(1.0)
    clock.t += 600  # ten idle minutes later the timer scrolls the chart
    view.refresh()
    rates = view.throughput_chart.rates()
    assert rates[-1] == 0.0 and rates[-11] == pytest.approx(2.0)


@pytest.mark.parametrize("size", [(160, 90), (320, 140), (520, 200), (1200, 400), (40, 20)])
def test_charts_paint_at_several_sizes(qtbot: QtBot, size: tuple[int, int]) -> None:
    minutes = [(T0 + 60 * i, 30.0 * (i % 7)) for i in range(60)]
    days = [(date(2025, 3, d), float(d * 10), d) for d in range(1, 15)]
    for chart, fill in ((ThroughputChart(), minutes), (DailyChart(), days)):
        qtbot.addWidget(chart)
        if isinstance(chart, ThroughputChart):
            chart.set_points(fill)  # type: ignore[arg-type]
        else:
            chart.set_days(fill)  # type: ignore[arg-type]
        chart.resize(*size)
        pixmap = chart.grab()
        assert not pixmap.isNull()
        assert pixmap.width() >= min(size[0], chart.minimumWidth())
        assert painted_colours(pixmap.toImage()) > 2


@pytest.mark.parametrize("chart_type", [ThroughputChart, DailyChart])
def test_empty_charts_paint_and_say_so(qtbot: QtBot, chart_type: type) -> None:
    chart = chart_type()
    qtbot.addWidget(chart)
    chart.resize(400, 150)
    assert chart.is_empty()
    assert painted_colours(chart.grab().toImage()) > 2  # axes and the empty-state text


def test_series_use_the_palette_highlight(qtbot: QtBot) -> None:
    chart = DailyChart()
    qtbot.addWidget(chart)
    pal = chart.palette()
    pal.setColor(pal.ColorRole.Highlight, QColor(200, 0, 0))
    chart.setPalette(pal)
    chart.set_days([(date(2025, 3, 10), 5.0, 1)])
    chart.resize(200, 120)
    image = chart.grab().toImage()
    assert image.pixelColor(image.width() // 2, image.height() - 30) == QColor(200, 0, 0)


def test_whole_view_renders(qtbot: QtBot, history: History) -> None:
    clock = Clock(T0)
    view = StatsView(history, clock=clock)
    qtbot.addWidget(view)
    for i in range(1, 40):
        clock.t = T0 + 60 * i
        view.update_status(status(i, 50.0 * i, 2.0 * i, 1_000_000 * i, 100_000 * i, i, 50.0 * i))
    for size in ((520, 360), (300, 300), (900, 700)):
        view.resize(*size)
        pixmap = view.grab()
        assert not pixmap.isNull() and painted_colours(pixmap.toImage()) > 2
