"""The worker's progress line in the log, under an injected time."""

from __future__ import annotations

import logging

import pytest

from client_app.session import SessionStats
from client_app.summary import TileSummary


def test_a_summary_follows_every_n_tiles_and_at_most_one_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="client_app")
    summary = TileSummary(every=2, min_interval_s=10.0)
    stats = SessionStats()
    summary.start_window(stats, 100.0)

    def tile(now: float) -> None:
        stats.tiles_done += 1
        stats.compute_s += 0.5
        stats.flop_done += 2_000_000_000
        summary.after_tile(stats, now)

    tile(101.0)
    assert caplog.text == ""
    tile(102.0)  # two tiles, 1 s of GEMMs in 2 s: half busy, 4 GFLOP in 1 s
    assert "computed 2 tiles in the last 2.0 s (busy 50%, 4.0 GFLOP/s)" in caplog.text
    tile(103.0)
    tile(104.0)  # two more, but only 2 s after the first line: not yet
    tile(112.5)
    assert caplog.text.count("computed") == 2
    assert "computed 3 tiles in the last 10.5 s" in caplog.text
    assert "total 5 tiles, 10.00 GFLOP" in caplog.text
