"""The contribution history: deltas across worker restarts, buckets, days, persistence."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import pytest
from support.statuses import st

from client_app.history import HISTORY_FILE, History, Totals

UTC = timezone.utc
# 2025-03-10 12:00:00 UTC, on a minute boundary.
T0 = datetime(2025, 3, 10, 12, 0, tzinfo=UTC).timestamp()


def open_history(tmp_path: Path, **kw: float) -> History:
    return History.open(tmp_path, tz=UTC, **kw)


def test_empty_history_has_zeros_everywhere(tmp_path: Path) -> None:
    with open_history(tmp_path) as h:
        assert h.session() == Totals()
        assert h.all_time() == Totals()
        points = h.throughput_last_hour(T0)
        assert len(points) == 60 and all(g == 0.0 for _, g in points)
        assert points[-1][0] == T0 and points[0][0] == T0 - 59 * 60
        days = h.per_day(14, T0)
        assert [d for d, _, _ in days][-1] == date(2025, 3, 10)
        assert len(days) == 14 and all(g == 0.0 and t == 0 for _, g, t in days)
    assert (tmp_path / HISTORY_FILE).exists()


def test_cumulative_counters_are_counted_once(tmp_path: Path) -> None:
    with open_history(tmp_path) as h:
        h.record(st(1, 2.0, 0.5, 100, 10), T0)
        h.record(st(1, 2.0, 0.5, 100, 10), T0 + 1)  # same figures again: nothing new
        h.record(st(3, 6.0, 1.5, 300, 30), T0 + 2)
        s = h.session()
        assert (s.tiles, s.gflop, s.compute_s, s.bytes_in, s.bytes_out) == (3, 6.0, 1.5, 300, 30)
        assert h.all_time() == s


def test_worker_restart_resets_are_detected_and_accumulated(tmp_path: Path) -> None:
    with open_history(tmp_path) as h:
        h.record(st(5, 10.0, 2.0, 500, 50), T0)
        h.record(st(0, 0.0, 0.0, 0, 0), T0 + 10)  # a new worker core starts from zero
        h.record(st(2, 4.0, 1.0, 200, 20), T0 + 20)
        # A reconnect first seen when its tiles already exceed the old run's: the
        # bytes (which grow with every message) fell, so it is a new run all the same.
        h.record(st(3, 6.0, 1.5, 50, 5), T0 + 30)
        s = h.session()
        assert (s.tiles, s.gflop, s.compute_s) == (10, 20.0, 4.5)
        assert (s.bytes_in, s.bytes_out) == (750, 75)


def test_throughput_buckets_per_minute(tmp_path: Path) -> None:
    with open_history(tmp_path) as h:
        h.record(st(1, 1.0), T0 + 5)
        h.record(st(2, 3.0), T0 + 50)  # same minute: 1 + 2 GFLOP
        h.record(st(3, 7.0), T0 + 60)  # next minute: 4
        h.record(st(4, 8.0), T0 + 60 * 30 + 1)  # half an hour later: 1
        now = T0 + 60 * 30 + 10
        points = dict(h.throughput_last_hour(now))
        assert len(points) == 60
        assert points[T0] == pytest.approx(3.0)
        assert points[T0 + 60] == pytest.approx(4.0)
        assert points[T0 + 1800] == pytest.approx(1.0)
        assert sum(points.values()) == pytest.approx(8.0)
        # An hour later the early minutes have scrolled out of the window.
        later = dict(h.throughput_last_hour(T0 + 3600 + 60))
        assert T0 not in later and T0 + 60 not in later
        assert later[T0 + 1800] == pytest.approx(1.0)


def test_day_boundaries_follow_the_given_time_zone(tmp_path: Path) -> None:
    midnight = datetime(2025, 3, 11, tzinfo=UTC).timestamp()
    with open_history(tmp_path) as h:
        h.record(st(1, 1.0), midnight - 1)
        h.record(st(3, 4.0), midnight)
        h.record(st(4, 6.0), midnight + 86400 * 2 + 5)
        days = h.per_day(4, midnight + 86400 * 2 + 10)
    assert days == [
        (date(2025, 3, 10), 1.0, 1),
        (date(2025, 3, 11), 3.0, 2),
        (date(2025, 3, 12), 0.0, 0),
        (date(2025, 3, 13), 2.0, 1),
    ]
    # The same instants in UTC+2 fall on other local days.
    plus2 = timezone(timedelta(hours=2))
    with History.open(tmp_path / "tz", tz=plus2) as h2:
        h2.record(st(1, 1.0), midnight - 3 * 3600)  # 23:00 local on the 10th
        h2.record(st(2, 2.0), midnight - 3600)  # 01:00 local on the 11th
        assert h2.per_day(2, midnight) == [(date(2025, 3, 10), 1.0, 1), (date(2025, 3, 11), 1.0, 1)]


def test_history_survives_reopen_and_session_starts_fresh(tmp_path: Path) -> None:
    with open_history(tmp_path) as h:
        h.record(st(5, 10.0, 2.0, 500, 50, credit_tiles=4, credit_gflop=8.0), T0)
    with open_history(tmp_path) as h:
        assert h.session() == Totals()
        a = h.all_time()
        assert (a.tiles, a.gflop, a.compute_s, a.bytes_in, a.bytes_out) == (5, 10.0, 2.0, 500, 50)
        assert (a.credit_tiles, a.credit_gflop) == (4, 8.0)
        assert dict(h.throughput_last_hour(T0 + 120))[T0] == 10.0
        assert h.per_day(1, T0) == [(date(2025, 3, 10), 10.0, 5)]
        # The new app run's worker starts its counters from zero again.
        h.record(st(2, 4.0, 1.0, 100, 10, credit_tiles=6, credit_gflop=12.0), T0 + 3600)
        s, a = h.session(), h.all_time()
        assert (s.tiles, s.credit_tiles, s.credit_gflop) == (2, 2, 4.0)
        assert (a.tiles, a.credit_tiles, a.credit_gflop) == (7, 6, 12.0)
        assert h.per_day(1, T0 + 3600) == [(date(2025, 3, 10), 14.0, 7)]


def test_flushes_at_most_every_interval_and_on_close(tmp_path: Path) -> None:
    db = tmp_path / HISTORY_FILE

    def stored_tiles() -> int:
        with sqlite3.connect(db) as conn:
            row = conn.execute("SELECT COALESCE(SUM(tiles), 0) FROM days").fetchone()
        return int(row[0])

    h = open_history(tmp_path, flush_interval_s=5.0)
    h.record(st(1, 1.0), T0)
    h.record(st(2, 2.0), T0 + 1)
    assert stored_tiles() == 0  # not yet: writes are batched
    h.record(st(3, 3.0), T0 + 5)
    assert stored_tiles() == 3
    h.record(st(4, 4.0), T0 + 6)
    assert stored_tiles() == 3
    h.close()
    assert stored_tiles() == 4
    h.record(st(9, 9.0), T0 + 20)  # after close: ignored, no crash


def test_credit_is_the_coordinators_figure(tmp_path: Path) -> None:
    with open_history(tmp_path) as h:
        # No Ack yet (0) says nothing; no worker id yet means no ledger to name.
        h.record(st(1, 1.0), T0)
        h.record(st(2, 2.0, credit_tiles=9, worker_id=""), T0 + 1)
        assert h.all_time().credit_tiles == 0
        h.record(st(3, 3.0, credit_tiles=2, credit_gflop=2.0), T0 + 2)
        h.record(st(4, 4.0, credit_tiles=3, credit_gflop=3.0), T0 + 3)
        # A restarted worker reports 0 until its first Ack: credit must not drop.
        h.record(st(0, 0.0), T0 + 4)
        assert h.all_time().credit_tiles == 3
        # Another coordinator's ledger adds up with the first.
        h.record(st(1, 1.0, credit_tiles=5, credit_gflop=5.0, url="wss://other"), T0 + 5)
        assert (h.all_time().credit_tiles, h.all_time().credit_gflop) == (8, 8.0)
        # A fresh ledger at the first address (figure fell): the old credit is banked.
        h.record(st(2, 2.0, credit_tiles=1, credit_gflop=1.0), T0 + 6)
        assert (h.all_time().credit_tiles, h.all_time().credit_gflop) == (9, 9.0)
        assert h.session().credit_tiles == 9
    with open_history(tmp_path) as h:
        assert h.all_time().credit_tiles == 9
        assert h.session().credit_tiles == 0


def test_records_at_a_high_rate_touch_the_database_only_once_per_interval(
    tmp_path: Path,
) -> None:
    """What keeps ``record`` cheap: it counts in memory, and only a flush writes."""
    n = 20_000
    with (
        open_history(tmp_path, flush_interval_s=5.0) as h,
        closing(sqlite3.connect(tmp_path / HISTORY_FILE)) as watcher,
    ):
        # The watcher sees data_version change after each commit by the history.
        def version() -> int:
            return int(watcher.execute("PRAGMA data_version").fetchone()[0])

        writes_at, last = [], version()
        for i in range(n):  # 1,000 updates a second for 20 simulated seconds
            now = T0 + i / 1000
            h.record(st(i, i * 0.5, i * 0.01, i * 1000, i * 10, credit_tiles=i // 2), now)
            if version() != last:
                writes_at.append(now - T0)
                last = version()
        assert h.session().tiles == n - 1
    assert writes_at == pytest.approx([5.0, 10.0, 15.0])


def test_corrupt_file_is_moved_aside(tmp_path: Path) -> None:
    (tmp_path / HISTORY_FILE).write_bytes(b"this is not a database" * 100)
    with open_history(tmp_path) as h:
        assert h.all_time() == Totals()
        h.record(st(1, 1.0), T0)
    assert list(tmp_path.glob(HISTORY_FILE + ".corrupt*"))
    with open_history(tmp_path) as h:
        assert h.all_time().tiles == 1


def test_old_minute_buckets_are_pruned_on_flush(tmp_path: Path) -> None:
    with open_history(tmp_path) as h:
        h.record(st(1, 1.0), T0)
        h.record(st(2, 2.0), T0 + 6 * 3600)
    with sqlite3.connect(tmp_path / HISTORY_FILE) as conn:
        minutes = [m for (m,) in conn.execute("SELECT minute FROM minutes")]
    assert minutes == [int(T0) + 6 * 3600]
