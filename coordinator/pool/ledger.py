"""SQLite ledger of every worker's verified contribution and standing, in the state directory.

Rows are keyed by the worker's Ed25519 public key (hex), which the worker proves it holds
at every connection (``common.auth``): credit, reputation and bans follow the key, never
the name a worker claims (names are for people and may repeat). Every verified tile is
committed within moments of landing (``Ledger``), in WAL mode.

Rows that exist are also kept in memory, updated with every write: the coordinator reads
a worker's standing on every heartbeat and check, and must not query SQLite on its event
loop for that. Keys with no row are not remembered, so strangers leave nothing behind.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from common.signing import fingerprint
from coordinator.pool.reputation import FULL

SCHEMA = """
CREATE TABLE IF NOT EXISTS contributions (
    worker TEXT PRIMARY KEY,
    tiles INTEGER NOT NULL DEFAULT 0,
    flops INTEGER NOT NULL DEFAULT 0,
    bytes_down INTEGER NOT NULL DEFAULT 0,
    bytes_up INTEGER NOT NULL DEFAULT 0,
    compute_s REAL NOT NULL DEFAULT 0,
    rejected INTEGER NOT NULL DEFAULT 0,
    first_seen REAL,
    last_seen REAL
);
"""
# Added after the first release of the schema; an older ledger gains them on open.
ADDED_COLUMNS = {
    "name": "TEXT NOT NULL DEFAULT ''",
    "reputation": f"REAL NOT NULL DEFAULT {FULL}",
    "banned_reason": "TEXT NOT NULL DEFAULT ''",
    "banned_at": "REAL",
}
COLUMNS = "worker, name, tiles, flops, bytes_down, bytes_up, compute_s, rejected, reputation, "
COLUMNS += "banned_reason"


ABSENT_REMEMBERED = 65_536  # keys without a row kept in memory: a few MiB at most


@dataclass(frozen=True)
class Contribution:
    worker: str  # the worker's public key, hex
    name: str = ""  # the name it last joined with
    tiles: int = 0
    flops: int = 0
    bytes_down: int = 0  # coordinator -> worker (operands)
    bytes_up: int = 0  # worker -> coordinator (results)
    compute_s: float = 0.0
    rejected: int = 0
    reputation: float = FULL
    banned_reason: str = ""  # non-empty: banned, and why

    @property
    def gflop(self) -> float:
        return self.flops / 1e9

    @property
    def key_fingerprint(self) -> str:
        try:
            return fingerprint(self.worker)
        except ValueError:  # a row from before keys (keyed by name)
            return self.worker

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "tiles": self.tiles,
            "gflop": round(self.gflop, 3),
            "bytes_down": self.bytes_down,
            "bytes_up": self.bytes_up,
            "compute_s": round(self.compute_s, 3),
            "rejected": self.rejected,
            "reputation": round(self.reputation, 4),
            "banned": self.banned_reason,
        }


# One worker's gathered writes, added to its row (or making it).
UPSERT = """INSERT INTO contributions
    (worker, name, tiles, flops, bytes_down, bytes_up, compute_s, rejected, reputation,
     banned_reason, banned_at, first_seen, last_seen)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT(worker) DO UPDATE SET
        name = excluded.name,
        tiles = tiles + excluded.tiles,
        flops = flops + excluded.flops,
        bytes_down = bytes_down + excluded.bytes_down,
        bytes_up = bytes_up + excluded.bytes_up,
        compute_s = compute_s + excluded.compute_s,
        rejected = rejected + excluded.rejected,
        reputation = excluded.reputation,
        banned_reason = CASE WHEN banned_reason = ''
            THEN excluded.banned_reason ELSE banned_reason END,
        banned_at = COALESCE(banned_at, excluded.banned_at),
        last_seen = excluded.last_seen"""


@dataclass
class _Pending:
    """What a worker's uncommitted credits and rejections add to its row."""

    first_seen: float
    last_seen: float = 0.0
    name: str = ""
    tiles: int = 0
    flops: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    compute_s: float = 0.0
    rejected: int = 0
    reputation: float = FULL
    banned_reason: str = ""
    banned_at: float | None = None

    def add(
        self,
        *,
        reputation: float,
        tiles: int = 0,
        flops: int = 0,
        bytes_down: int = 0,
        bytes_up: int = 0,
        compute_s: float = 0.0,
        rejected: int = 0,
    ) -> None:
        self.tiles += tiles
        self.flops += flops
        self.bytes_down += bytes_down
        self.bytes_up += bytes_up
        self.compute_s += compute_s
        self.rejected += rejected
        self.reputation = reputation  # the latest

    def params(self, worker: str) -> tuple[object, ...]:
        return (
            worker,
            self.name,
            self.tiles,
            self.flops,
            self.bytes_down,
            self.bytes_up,
            self.compute_s,
            self.rejected,
            self.reputation,
            self.banned_reason,
            self.banned_at,
            self.first_seen,
            self.last_seen,
        )


class Ledger:
    """Each worker's credit, in SQLite, with the rows also kept in memory.

    ``credit`` and ``reject`` change the row in memory at once and queue their write;
    ``flush`` commits what is queued in one transaction. The server has a thread of
    its own flush after each turn of its event loop that made writes, so the tiles
    verified in one turn cost one commit rather than one each, the loop never waits
    for SQLite, and a crash loses at most the credit of the last turn or two (tiles
    of the step in flight, which is recomputed).

    Two locks: one for the rows and the queue, held only for moments, so a credit
    never waits for a commit; one for the connection, held by each flush from taking
    the queue to its commit, so batches land in the order they were made.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # One connection, used by the flushing thread, the event loop (a stranger's row)
        # and the training thread's summaries.
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db_lock = threading.Lock()
        self._lock = threading.Lock()
        self._rows: dict[str, Contribution] = {}  # worker key -> its row, as in the memory
        self._absent: set[str] = set()  # keys the file has no row for (a read cache)
        # Writes not yet committed, one change per worker: the credits of a turn of the
        # loop are one row update each worker, not one per tile.
        self._queued: dict[str, _Pending] = {}
        self._writes = 0  # the credits and rejections gathered in ``_queued``
        self._committing = 0  # writes taken from the queue by the commit under way
        with self._db_lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            have = {row[1] for row in self._db.execute("PRAGMA table_info(contributions)")}
            for column, decl in ADDED_COLUMNS.items():
                if column not in have:
                    self._db.execute(f"ALTER TABLE contributions ADD COLUMN {column} {decl}")
            if "name" not in have:
                # Rows from before keys were keyed by name: keep showing that name.
                self._db.execute("UPDATE contributions SET name = worker")

    def credit(
        self,
        worker: str,
        *,
        name: str,
        flops: int,
        bytes_down: int,
        bytes_up: int,
        compute_s: float,
        reputation: float,
        now: float,
    ) -> None:
        """One verified tile: credit it, with the worker's reputation after it."""
        loaded = self._row(worker)
        with self._lock:
            before = self._rows.get(worker, loaded)  # read first: the write below changes it
            self._pending(worker, name, now).add(
                tiles=1,
                flops=flops,
                bytes_down=bytes_down,
                bytes_up=bytes_up,
                compute_s=compute_s,
                reputation=reputation,
            )
            self._rows[worker] = replace(
                before,
                name=name,
                tiles=before.tiles + 1,
                flops=before.flops + flops,
                bytes_down=before.bytes_down + bytes_down,
                bytes_up=before.bytes_up + bytes_up,
                compute_s=before.compute_s + compute_s,
                reputation=reputation,
            )

    def reject(
        self, worker: str, *, name: str, reputation: float, banned_reason: str = "", now: float
    ) -> None:
        """One result that failed its check: no credit, a lower reputation, maybe a ban."""
        loaded = self._row(worker)
        with self._lock:
            before = self._rows.get(worker, loaded)  # read first: the write below changes it
            pending = self._pending(worker, name, now)
            pending.add(rejected=1, reputation=reputation)
            if banned_reason and not pending.banned_reason:
                pending.banned_reason, pending.banned_at = banned_reason, now
            self._rows[worker] = replace(
                before,
                name=name,
                rejected=before.rejected + 1,
                reputation=reputation,
                banned_reason=before.banned_reason or banned_reason,
            )

    def _pending(self, worker: str, name: str, now: float) -> _Pending:
        """The worker's writes not yet committed, gathered into one row's change.
        (The caller holds ``_lock``.)"""
        pending = self._queued.get(worker)
        if pending is None:
            pending = self._queued[worker] = _Pending(first_seen=now)
        pending.name, pending.last_seen = name, now
        self._writes += 1
        return pending

    @property
    def queued(self) -> int:
        """Writes made but not yet committed (queued, or in the commit under way)."""
        with self._lock:
            return self._writes + self._committing

    def flush(self) -> None:
        """Commit the queued writes, in the order they were made, in one transaction."""
        with self._db_lock:
            self._flush()

    def _flush(self) -> None:
        """(The caller holds the connection's lock.)"""
        with self._lock:
            queued, self._queued = self._queued, {}
            self._committing, self._writes = self._writes, 0
        if not queued:
            return
        try:
            self._db.execute("BEGIN")
            try:
                for worker, pending in queued.items():
                    self._db.execute(UPSERT, pending.params(worker))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        finally:
            self._committing = 0

    def get(self, worker: str) -> Contribution:
        return self._row(worker)

    def _row(self, worker: str) -> Contribution:
        """The row from memory, or read once from the file. A row with writes queued is
        always in memory (the writes put it there), so the file has all of a row that
        is not. Workers the file has no row for are remembered too (up to a bound, as
        strangers' keys are free to make): their heartbeats before their first verified
        tile would otherwise each read the file on the event loop, waiting behind any
        commit under way."""
        with self._lock:
            cached = self._rows.get(worker)
            absent = worker in self._absent
        if cached is not None:
            return cached
        if absent:
            return Contribution(worker)
        with self._db_lock:
            row = self._db.execute(
                f"SELECT {COLUMNS} FROM contributions WHERE worker = ?", (worker,)
            ).fetchone()
        with self._lock:
            if row is None:
                if len(self._absent) >= ABSENT_REMEMBERED:
                    self._absent.clear()
                self._absent.add(worker)
                return self._rows.get(worker, Contribution(worker))  # or a credit since
            return self._rows.setdefault(worker, Contribution(*row))

    def _select(self, where: str, order: str) -> list[Contribution]:
        """Rows from the file, after committing what is queued."""
        with self._db_lock:
            self._flush()
            rows = self._db.execute(
                f"SELECT {COLUMNS} FROM contributions {where} ORDER BY {order}"
            ).fetchall()
        return [Contribution(*row) for row in rows]

    def all(self) -> list[Contribution]:
        return self._select("", "flops DESC, worker")

    def banned(self) -> list[Contribution]:
        return self._select("WHERE banned_reason != ''", "banned_at, worker")

    def close(self) -> None:
        with self._db_lock:
            self._flush()
            self._db.close()
