"""SQLite ledger of every worker's verified contribution, in the state directory.

Rows are keyed by the worker's name (a later change keys them by the worker's own
Ed25519 key). Every verified tile is committed as it lands, in WAL mode, so a crash
loses nothing that was credited.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class Contribution:
    worker: str
    tiles: int = 0
    flops: int = 0
    bytes_down: int = 0  # coordinator -> worker (operands)
    bytes_up: int = 0  # worker -> coordinator (results)
    compute_s: float = 0.0
    rejected: int = 0

    @property
    def gflop(self) -> float:
        return self.flops / 1e9

    def to_json(self) -> dict[str, object]:
        return {
            "tiles": self.tiles,
            "gflop": round(self.gflop, 3),
            "bytes_down": self.bytes_down,
            "bytes_up": self.bytes_up,
            "compute_s": round(self.compute_s, 3),
            "rejected": self.rejected,
        }


class Ledger:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # One connection shared under a lock: writes come from the event loop, reads
        # also from the training thread's summaries.
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)

    def credit(
        self,
        worker: str,
        *,
        flops: int,
        bytes_down: int,
        bytes_up: int,
        compute_s: float,
        now: float,
    ) -> None:
        with self._lock:
            self._db.execute(
                """INSERT INTO contributions
                   (worker, tiles, flops, bytes_down, bytes_up, compute_s,
                    first_seen, last_seen)
                   VALUES (?, 1, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT(worker) DO UPDATE SET
                       tiles = tiles + 1, flops = flops + excluded.flops,
                       bytes_down = bytes_down + excluded.bytes_down,
                       bytes_up = bytes_up + excluded.bytes_up,
                       compute_s = compute_s + excluded.compute_s,
                       last_seen = excluded.last_seen""",
                (worker, flops, bytes_down, bytes_up, compute_s, now, now),
            )

    def reject(self, worker: str, *, now: float) -> None:
        with self._lock:
            self._db.execute(
                """INSERT INTO contributions (worker, rejected, first_seen, last_seen)
                   VALUES (?, 1, ?, ?)
                   ON CONFLICT(worker) DO UPDATE SET rejected = rejected + 1,
                       last_seen = excluded.last_seen""",
                (worker, now, now),
            )

    def get(self, worker: str) -> Contribution:
        with self._lock:
            row = self._db.execute(
                "SELECT worker, tiles, flops, bytes_down, bytes_up, compute_s, rejected "
                "FROM contributions WHERE worker = ?",
                (worker,),
            ).fetchone()
        return Contribution(*row) if row else Contribution(worker)

    def all(self) -> list[Contribution]:
        with self._lock:
            rows = self._db.execute(
                "SELECT worker, tiles, flops, bytes_down, bytes_up, compute_s, rejected "
                "FROM contributions ORDER BY flops DESC, worker"
            ).fetchall()
        return [Contribution(*row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
