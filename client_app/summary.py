"""The worker's progress line in the log: tiles, busy share and GFLOP/s per window.

Small tiles finish in milliseconds, so a line per tile would drown the log: a summary
follows every ``every`` tiles and, after the first one, at most one per ``min_interval_s``.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from client_app.session import SessionStats

log = logging.getLogger("client_app.worker")  # where an operator has always found it


class _Mark(NamedTuple):
    tiles: int
    compute_s: float
    flop: int
    at: float  # wall time when the window started


class TileSummary:
    """Logs how the worker did since the last line (or since it joined)."""

    def __init__(self, *, every: int, min_interval_s: float) -> None:
        self._every = every
        self._min_interval_s = min_interval_s
        self._lines = 0
        self._mark = _Mark(0, 0.0, 0, 0.0)

    def start_window(self, stats: SessionStats, now: float) -> None:
        """Count from here (a join: the time before it was not spent working)."""
        self._mark = _Mark(stats.tiles_done, stats.compute_s, stats.flop_done, now)

    def after_tile(self, stats: SessionStats, now: float) -> None:
        """Log a summary if one is due after the tile just done."""
        mark = self._mark
        if stats.tiles_done - mark.tiles < self._every:
            return
        if self._lines and now - mark.at < self._min_interval_s:
            return
        self._lines += 1
        wall = now - mark.at
        busy = stats.compute_s - mark.compute_s
        flop = stats.flop_done - mark.flop
        log.info(
            "computed %d tiles in the last %.1f s (busy %.0f%%, %.1f GFLOP/s); "
            "total %d tiles, %.2f GFLOP; credit %d tiles",
            stats.tiles_done - mark.tiles,
            wall,
            100.0 * busy / max(wall, 1e-9),
            flop / max(busy, 1e-9) / 1e9,
            stats.tiles_done,
            stats.flop_done / 1e9,
            stats.credit_tiles,
        )
        self.start_window(stats, now)
