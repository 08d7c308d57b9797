"""The volunteer's contribution history, kept locally across restarts (Qt-free).

``History.record`` is fed every ``WorkerStatus`` the worker publishes. Statuses carry
*cumulative* counters of one worker run, which start again at 0 when a new worker
core starts (leave and join again, app restart), so the history keeps the last figures
seen and adds only the differences. Those deltas go into per-minute buckets (the last
hour's throughput chart), per-local-day rows (the per-day chart and the all-time
totals) and the running session totals.

Verified credit is different: it is the coordinator's own ledger figure for this
worker, all-time by nature, sent back in every Ack. It is kept per (coordinator,
worker id); if a coordinator's figure ever falls (a fresh ledger, a new training run at
the same address) the old figure is banked, so credit once granted is not forgotten.

Storage is SQLite in WAL mode (stdlib; survives crashes). Records only touch memory;
dirty rows are written at most every ``flush_interval_s`` seconds and on ``close()``,
so the many status updates per second of a busy worker stay cheap. A crash loses at
most those few seconds of statistics, never the file.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from dataclasses import dataclass
from datetime import date, datetime, timedelta, tzinfo
from pathlib import Path

from client_app.status import WorkerStatus

log = logging.getLogger(__name__)

HISTORY_FILE = "history.sqlite"
MINUTE_S = 60
HOUR_MINUTES = 60
DEFAULT_FLUSH_INTERVAL_S = 5.0
# Minute buckets older than this are dropped at each flush: only the last hour is shown.
KEEP_MINUTES_S = 2 * 3600

_SCHEMA = """
CREATE TABLE IF NOT EXISTS days (
    day TEXT PRIMARY KEY,            -- local date, ISO format
    tiles INTEGER NOT NULL,
    gflop REAL NOT NULL,
    compute_s REAL NOT NULL,
    bytes_in INTEGER NOT NULL,
    bytes_out INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS minutes (
    minute INTEGER PRIMARY KEY,      -- unix time of the minute's start
    tiles INTEGER NOT NULL,
    gflop REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS credit (
    coordinator TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    banked_tiles INTEGER NOT NULL,   -- from earlier ledgers at this address
    banked_gflop REAL NOT NULL,
    last_tiles INTEGER NOT NULL,     -- the coordinator's latest figure
    last_gflop REAL NOT NULL,
    PRIMARY KEY (coordinator, worker_id)
);
"""


@dataclass(frozen=True)
class Totals:
    """Contribution figures over some span (this session, or all time)."""

    tiles: int = 0
    gflop: float = 0.0
    compute_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    credit_tiles: int = 0  # verified by the coordinator (its ledger), not self-reported
    credit_gflop: float = 0.0


@dataclass
class _Counts:
    """Mutable sums for one bucket (a day, a minute, a session)."""

    tiles: int = 0
    gflop: float = 0.0
    compute_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0

    def add(self, other: _Counts) -> None:
        self.tiles += other.tiles
        self.gflop += other.gflop
        self.compute_s += other.compute_s
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out


@dataclass
class _Credit:
    banked_tiles: int = 0
    banked_gflop: float = 0.0
    last_tiles: int = 0
    last_gflop: float = 0.0

    @property
    def tiles(self) -> int:
        return self.banked_tiles + self.last_tiles

    @property
    def gflop(self) -> float:
        return self.banked_gflop + self.last_gflop


_CreditKey = tuple[str, str]  # (coordinator URL, worker id)


class History:
    """Session and all-time contribution, throughput per minute and per local day."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        tz: tzinfo | None = None,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
    ) -> None:
        self._conn = conn
        self._tz = tz  # None: the machine's local time zone
        self._flush_interval_s = flush_interval_s
        # One app thread records, but close() may come from another (shutdown hooks).
        self._lock = threading.Lock()
        self._last: WorkerStatus | None = None
        self._session = _Counts()
        self._all_time = _Counts()
        self._days: dict[str, _Counts] = {}
        self._minutes: dict[int, _Counts] = {}
        self._credit: dict[_CreditKey, _Credit] = {}
        self._credit_at_open: dict[_CreditKey, tuple[int, float]] = {}
        self._dirty_days: set[str] = set()
        self._dirty_minutes: set[int] = set()
        self._dirty_credit: set[_CreditKey] = set()
        self._last_flush: float | None = None
        self._closed = False
        self._load()

    # ---- opening and closing -------------------------------------------------------

    @classmethod
    def open(
        cls,
        config_dir: Path,
        *,
        tz: tzinfo | None = None,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
    ) -> History:
        """Load (or create) ``config_dir/history.sqlite``.

        A file SQLite cannot read is moved aside and a fresh history started: losing
        old statistics is better than an app that will not start.
        """
        config_dir.mkdir(parents=True, exist_ok=True)
        path = config_dir / HISTORY_FILE
        try:
            conn = _connect(path)
        except sqlite3.DatabaseError as exc:
            aside = _free_name(path.with_name(path.name + ".corrupt"))
            log.warning("history %s is unreadable (%s); moved to %s", path, exc, aside)
            path.rename(aside)
            for suffix in ("-wal", "-shm"):
                path.with_name(path.name + suffix).unlink(missing_ok=True)
            conn = _connect(path)
        return cls(conn, tz=tz, flush_interval_s=flush_interval_s)

    def close(self) -> None:
        """Write what is pending and close the file; later records are ignored."""
        with self._lock:
            if self._closed:
                return
            self._flush_locked(self._last_flush or 0.0)
            self._closed = True
            self._conn.close()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _load(self) -> None:
        for day, tiles, gflop, compute_s, b_in, b_out in self._conn.execute(
            "SELECT day, tiles, gflop, compute_s, bytes_in, bytes_out FROM days"
        ):
            counts = _Counts(int(tiles), float(gflop), float(compute_s), int(b_in), int(b_out))
            self._days[str(day)] = counts
            self._all_time.add(counts)
        for minute, tiles, gflop in self._conn.execute("SELECT minute, tiles, gflop FROM minutes"):
            self._minutes[int(minute)] = _Counts(tiles=int(tiles), gflop=float(gflop))
        for row in self._conn.execute(
            "SELECT coordinator, worker_id, banked_tiles, banked_gflop, last_tiles, last_gflop"
            " FROM credit"
        ):
            key = (str(row[0]), str(row[1]))
            credit = _Credit(int(row[2]), float(row[3]), int(row[4]), float(row[5]))
            self._credit[key] = credit
            self._credit_at_open[key] = (credit.tiles, credit.gflop)

    # ---- recording -----------------------------------------------------------------

    def record(self, status: WorkerStatus, now: float) -> None:
        """Account for one status update (cheap: memory only, a flush every few seconds)."""
        with self._lock:
            if self._closed:
                return
            delta = _delta(self._last, status)
            self._last = status
            if delta.tiles or delta.gflop or delta.compute_s or delta.bytes_in or delta.bytes_out:
                self._add(delta, now)
            self._record_credit(status)
            if self._last_flush is None:
                self._last_flush = now
            # A clock stepped backwards also flushes, so a bad clock cannot stall writes.
            elif now - self._last_flush >= self._flush_interval_s or now < self._last_flush:
                self._flush_locked(now)

    def _add(self, delta: _Counts, now: float) -> None:
        self._session.add(delta)
        self._all_time.add(delta)
        day = self._day_of(now).isoformat()
        self._days.setdefault(day, _Counts()).add(delta)
        self._dirty_days.add(day)
        minute = _minute_of(now)
        self._minutes.setdefault(minute, _Counts()).add(
            _Counts(tiles=delta.tiles, gflop=delta.gflop)
        )
        self._dirty_minutes.add(minute)

    def _record_credit(self, status: WorkerStatus) -> None:
        # Before the first Ack a status says 0: that is "not known yet", not a figure.
        if not status.worker_id or (status.credit_tiles <= 0 and status.credit_gflop <= 0):
            return
        key = (status.coordinator_url, status.worker_id)
        credit = self._credit.get(key)
        if credit is None:
            credit = self._credit[key] = _Credit()
        if status.credit_tiles == credit.last_tiles and status.credit_gflop == credit.last_gflop:
            return
        if status.credit_tiles < credit.last_tiles:
            # The ledger never takes credit back, so a lower figure is a new ledger.
            credit.banked_tiles += credit.last_tiles
            credit.banked_gflop += credit.last_gflop
        credit.last_tiles = status.credit_tiles
        credit.last_gflop = status.credit_gflop
        self._dirty_credit.add(key)

    def flush(self, now: float) -> None:
        """Write pending changes now (``record`` and ``close`` also do this)."""
        with self._lock:
            if not self._closed:
                self._flush_locked(now)

    def _flush_locked(self, now: float) -> None:
        self._last_flush = now
        oldest_kept = _minute_of(now) - KEEP_MINUTES_S
        stale = [m for m in self._minutes if m < oldest_kept]
        for minute in stale:
            del self._minutes[minute]
            self._dirty_minutes.discard(minute)
        if not (self._dirty_days or self._dirty_minutes or self._dirty_credit or stale):
            return
        with self._conn:  # one transaction: a crash leaves the old or the new figures
            self._conn.executemany(
                "INSERT OR REPLACE INTO days VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (d, c.tiles, c.gflop, c.compute_s, c.bytes_in, c.bytes_out)
                    for d in self._dirty_days
                    for c in (self._days[d],)
                ],
            )
            self._conn.executemany(
                "INSERT OR REPLACE INTO minutes VALUES (?, ?, ?)",
                [(m, self._minutes[m].tiles, self._minutes[m].gflop) for m in self._dirty_minutes],
            )
            self._conn.executemany(
                "INSERT OR REPLACE INTO credit VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (k[0], k[1], c.banked_tiles, c.banked_gflop, c.last_tiles, c.last_gflop)
                    for k in self._dirty_credit
                    for c in (self._credit[k],)
                ],
            )
            if stale:
                self._conn.execute("DELETE FROM minutes WHERE minute < ?", (oldest_kept,))
        self._dirty_days.clear()
        self._dirty_minutes.clear()
        self._dirty_credit.clear()

    # ---- queries -------------------------------------------------------------------

    def session(self) -> Totals:
        """Since this history was opened (app start), across worker restarts."""
        with self._lock:
            tiles, gflop = 0, 0.0
            for key, credit in self._credit.items():
                base_tiles, base_gflop = self._credit_at_open.get(key, (0, 0.0))
                tiles += max(0, credit.tiles - base_tiles)
                gflop += max(0.0, credit.gflop - base_gflop)
            return _totals(self._session, tiles, gflop)

    def all_time(self) -> Totals:
        with self._lock:
            tiles = sum(c.tiles for c in self._credit.values())
            gflop = sum(c.gflop for c in self._credit.values())
            return _totals(self._all_time, tiles, gflop)

    def throughput_last_hour(self, now: float) -> list[tuple[float, float]]:
        """60 points ``(minute_start, gflop)``, oldest first, ending with ``now``'s minute."""
        last = _minute_of(now)
        with self._lock:
            return [
                (float(m), self._minutes[m].gflop if m in self._minutes else 0.0)
                for m in range(last - (HOUR_MINUTES - 1) * MINUTE_S, last + 1, MINUTE_S)
            ]

    def per_day(self, days: int, now: float) -> list[tuple[date, float, int]]:
        """``days`` points ``(local date, gflop, tiles)``, oldest first, ending today."""
        today = self._day_of(now)
        out: list[tuple[date, float, int]] = []
        with self._lock:
            for back in range(days - 1, -1, -1):
                day = today - timedelta(days=back)
                counts = self._days.get(day.isoformat())
                out.append((day, counts.gflop, counts.tiles) if counts else (day, 0.0, 0))
        return out

    def _day_of(self, now: float) -> date:
        if self._tz is None:
            return datetime.fromtimestamp(now).date()
        return datetime.fromtimestamp(now, self._tz).date()


def _connect(path: Path) -> sqlite3.Connection:
    # check_same_thread=False: our own lock serialises every use of the connection.
    conn = sqlite3.connect(path, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode never corrupts; a power cut may lose the last flush only.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(_SCHEMA)
    except sqlite3.DatabaseError:
        conn.close()
        raise
    return conn


def _free_name(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.{n}")
        n += 1
    return candidate


def _minute_of(now: float) -> int:
    return int(now // MINUTE_S) * MINUTE_S


def _delta(last: WorkerStatus | None, new: WorkerStatus) -> _Counts:
    """What ``new`` adds over ``last``; a counter that fell means a new worker run."""
    if last is None:
        # The first status of this app run: whatever it carries was done since the
        # worker started, and the worker starts with the app, so it counts.
        return _counts_of(new)
    if (
        new.tiles_done < last.tiles_done
        or new.gflop_done < last.gflop_done
        or new.compute_s < last.compute_s
        or new.bytes_in < last.bytes_in
        or new.bytes_out < last.bytes_out
    ):
        return _counts_of(new)
    return _Counts(
        new.tiles_done - last.tiles_done,
        new.gflop_done - last.gflop_done,
        new.compute_s - last.compute_s,
        new.bytes_in - last.bytes_in,
        new.bytes_out - last.bytes_out,
    )


def _counts_of(status: WorkerStatus) -> _Counts:
    return _Counts(
        status.tiles_done, status.gflop_done, status.compute_s, status.bytes_in, status.bytes_out
    )


def _totals(counts: _Counts, credit_tiles: int, credit_gflop: float) -> Totals:
    return Totals(
        tiles=counts.tiles,
        gflop=counts.gflop,
        compute_s=counts.compute_s,
        bytes_in=counts.bytes_in,
        bytes_out=counts.bytes_out,
        credit_tiles=credit_tiles,
        credit_gflop=credit_gflop,
    )
