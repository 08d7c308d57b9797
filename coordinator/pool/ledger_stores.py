"""Where the ledger's rows live: one interface, three stores.

- ``SqliteStore``: a file in the state directory, the embedded default for one
  coordinator (WAL mode; older files gain the columns added since on open);
- ``PostgresStore``: a PostgreSQL database (``--ledger postgresql://...``), the store
  several coordinator ranks of one job can share;
- ``MemoryStore``: rows in this process only, for the simulator and tests.

A store only reads every row once (when the ledger opens) and commits batches of
additive changes, one transaction each; the ledger (``coordinator.pool.ledger``) keeps the
rows in memory and decides when to commit. Beside the rows, a store journals what each GEMM
of the steps no checkpoint covers yet has paid (``coordinator.pool.payouts``), committed
in the same transaction as the credit it records. The same test suite runs against all three
(``tests/loopback/test_coordinator_ledger.py``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

from common.signing import fingerprint
from coordinator.pool.payouts import Payout
from coordinator.pool.reputation import FULL

MEMORY = ":memory:"


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
    banned_at: float | None = None  # when it was first banned

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


# The row's columns, in ``Contribution``'s order: every SELECT reads these.
COLUMNS = ", ".join(f.name for f in fields(Contribution))


@dataclass
class RowChange:
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

    def merge(self, later: RowChange) -> None:
        """Add a later change of the same worker's row to this one."""
        self.name, self.last_seen = later.name, later.last_seen
        self.tiles += later.tiles
        self.flops += later.flops
        self.bytes_down += later.bytes_down
        self.bytes_up += later.bytes_up
        self.compute_s += later.compute_s
        self.rejected += later.rejected
        self.reputation = later.reputation  # the latest
        if later.banned_reason and not self.banned_reason:
            self.banned_reason, self.banned_at = later.banned_reason, later.banned_at

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

    def applied_to(self, row: Contribution) -> Contribution:
        """``row`` with this change added, as the store's upsert adds it."""
        # Built field by field: dataclasses.replace costs several times more, twice a tile.
        return Contribution(
            row.worker,
            name=self.name,
            tiles=row.tiles + self.tiles,
            flops=row.flops + self.flops,
            bytes_down=row.bytes_down + self.bytes_down,
            bytes_up=row.bytes_up + self.bytes_up,
            compute_s=row.compute_s + self.compute_s,
            rejected=row.rejected + self.rejected,
            reputation=self.reputation,
            banned_reason=row.banned_reason or self.banned_reason,
            banned_at=row.banned_at if row.banned_at is not None else self.banned_at,
        )


class LedgerStore(Protocol):
    """Rows of contributions, keyed by worker key. Called from one thread at a time."""

    def rows(self) -> list[Contribution]:
        """Every row, as committed."""
        ...

    def payouts(self, scope: str) -> list[Payout]:
        """The journaled payouts of ``scope``."""
        ...

    def commit(self, changes: Mapping[str, RowChange], payouts: Sequence[Payout] = ()) -> None:
        """Add each worker's change to its row (making the row where there is none) and
        journal ``payouts``, all in one transaction: either everything lands or nothing."""
        ...

    def forget_payouts(self, scope: str, before_step: int) -> None:
        """Drop ``scope``'s payouts of the steps before ``before_step``."""
        ...

    def close(self) -> None: ...


class MemoryStore:
    """Rows in this process only (the simulator, tests): gone when it ends."""

    def __init__(self) -> None:
        self._rows: dict[str, Contribution] = {}
        self.seen: dict[str, tuple[float, float]] = {}  # worker -> (first, last) seen
        self._payouts: dict[tuple[str, str], Payout] = {}

    def rows(self) -> list[Contribution]:
        return list(self._rows.values())

    def payouts(self, scope: str) -> list[Payout]:
        return [p for p in self._payouts.values() if p.scope == scope]

    def commit(self, changes: Mapping[str, RowChange], payouts: Sequence[Payout] = ()) -> None:
        rows = dict(self._rows)
        for worker, change in changes.items():
            rows[worker] = change.applied_to(rows.get(worker, Contribution(worker)))
            first = self.seen.get(worker, (change.first_seen, 0.0))[0]
            self.seen[worker] = (first, change.last_seen)
        journal = dict(self._payouts)
        for p in payouts:
            had = journal.get((p.scope, p.gemm))
            journal[p.scope, p.gemm] = replace(p, flops=p.flops + (had.flops if had else 0))
        self._rows, self._payouts = rows, journal  # all or nothing, as a transaction

    def forget_payouts(self, scope: str, before_step: int) -> None:
        self._payouts = {
            k: p for k, p in self._payouts.items() if p.scope != scope or p.step >= before_step
        }

    def close(self) -> None:
        pass


# One worker's gathered change, added to its row (or making it). ``{p}`` is the driver's
# parameter marker (``?`` or ``%s``); the rest is the SQL both SQLite and PostgreSQL speak.
_UPSERT = """INSERT INTO contributions
    (worker, name, tiles, flops, bytes_down, bytes_up, compute_s, rejected, reputation,
     banned_reason, banned_at, first_seen, last_seen)
    VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p})
    ON CONFLICT(worker) DO UPDATE SET
        name = excluded.name,
        tiles = contributions.tiles + excluded.tiles,
        flops = contributions.flops + excluded.flops,
        bytes_down = contributions.bytes_down + excluded.bytes_down,
        bytes_up = contributions.bytes_up + excluded.bytes_up,
        compute_s = contributions.compute_s + excluded.compute_s,
        rejected = contributions.rejected + excluded.rejected,
        reputation = excluded.reputation,
        banned_reason = CASE WHEN contributions.banned_reason = ''
            THEN excluded.banned_reason ELSE contributions.banned_reason END,
        banned_at = COALESCE(contributions.banned_at, excluded.banned_at),
        last_seen = excluded.last_seen"""

# What a GEMM of a step paid in one commit, added to what it paid before.
_JOURNAL = """INSERT INTO payouts (scope, gemm, step, flops) VALUES ({p}, {p}, {p}, {p})
    ON CONFLICT(scope, gemm) DO UPDATE SET flops = payouts.flops + excluded.flops"""
_PAYOUTS = "SELECT scope, step, gemm, flops FROM payouts WHERE scope = {p}"
_FORGET = "DELETE FROM payouts WHERE scope = {p} AND step < {p}"


def _journal_params(payout: Payout) -> tuple[object, ...]:
    return (payout.scope, payout.gemm, payout.step, payout.flops)


def _schema(integer: str, real: str) -> str:
    return f"""
CREATE TABLE IF NOT EXISTS contributions (
    worker TEXT PRIMARY KEY,
    tiles {integer} NOT NULL DEFAULT 0,
    flops {integer} NOT NULL DEFAULT 0,
    bytes_down {integer} NOT NULL DEFAULT 0,
    bytes_up {integer} NOT NULL DEFAULT 0,
    compute_s {real} NOT NULL DEFAULT 0,
    rejected {integer} NOT NULL DEFAULT 0,
    first_seen {real},
    last_seen {real},
    name TEXT NOT NULL DEFAULT '',
    reputation {real} NOT NULL DEFAULT {FULL},
    banned_reason TEXT NOT NULL DEFAULT '',
    banned_at {real}
);
CREATE TABLE IF NOT EXISTS payouts (
    scope TEXT NOT NULL,
    gemm TEXT NOT NULL,
    step {integer} NOT NULL,
    flops {integer} NOT NULL,
    PRIMARY KEY (scope, gemm)
);
"""


# Columns added after the first release of the SQLite schema; an older file gains them.
ADDED_COLUMNS = {
    "name": "TEXT NOT NULL DEFAULT ''",
    "reputation": f"REAL NOT NULL DEFAULT {FULL}",
    "banned_reason": "TEXT NOT NULL DEFAULT ''",
    "banned_at": "REAL",
}


class SqliteStore:
    """A SQLite file: the embedded default."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        have = {row[1] for row in self.db.execute("PRAGMA table_info(contributions)")}
        self.db.executescript(_schema("INTEGER", "REAL"))  # what an older file lacks
        if not have:
            return
        for column, decl in ADDED_COLUMNS.items():
            if column not in have:
                self.db.execute(f"ALTER TABLE contributions ADD COLUMN {column} {decl}")
        if "name" not in have:
            # Rows from before keys were keyed by name: keep showing that name.
            self.db.execute("UPDATE contributions SET name = worker")

    def rows(self) -> list[Contribution]:
        rows = self.db.execute(f"SELECT {COLUMNS} FROM contributions").fetchall()
        return [Contribution(*row) for row in rows]

    def payouts(self, scope: str) -> list[Payout]:
        return [Payout(*row) for row in self.db.execute(_PAYOUTS.format(p="?"), (scope,))]

    def commit(self, changes: Mapping[str, RowChange], payouts: Sequence[Payout] = ()) -> None:
        self.db.execute("BEGIN")
        try:
            self.db.executemany(_UPSERT.format(p="?"), [c.params(w) for w, c in changes.items()])
            self.db.executemany(_JOURNAL.format(p="?"), map(_journal_params, payouts))
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def forget_payouts(self, scope: str, before_step: int) -> None:
        self.db.execute(_FORGET.format(p="?"), (scope, before_step))

    def close(self) -> None:
        self.db.close()


class PostgresStore:
    """A PostgreSQL database, which several coordinator ranks of one job can share.

    ``url``: a libpq connection string (``postgresql://user@host:port/dbname``). The
    table is created if missing. Commits are one transaction each, so a rank killed
    mid-commit leaves the rows as they were before it.
    """

    def __init__(self, url: str) -> None:
        import psycopg  # only where PostgreSQL is used: the embedded default needs none

        self._connect = lambda: psycopg.connect(url, autocommit=True)
        self.db: Any = self._connect()
        self.db.execute(_schema("BIGINT", "DOUBLE PRECISION"))

    def _connected(self) -> Any:
        """The connection, made again if the last one was lost (the server restarted, a
        proxy dropped it): the commit that met the loss failed and is tried again."""
        if self.db.broken or self.db.closed:
            self.db = self._connect()
        return self.db

    def rows(self) -> list[Contribution]:
        rows = self.db.execute(f"SELECT {COLUMNS} FROM contributions").fetchall()
        return [Contribution(*row) for row in rows]

    def payouts(self, scope: str) -> list[Payout]:
        rows = self.db.execute(_PAYOUTS.format(p="%s"), (scope,)).fetchall()
        return [Payout(*row) for row in rows]

    def commit(self, changes: Mapping[str, RowChange], payouts: Sequence[Payout] = ()) -> None:
        db = self._connected()
        with db.transaction(), db.cursor() as cur:
            if changes:
                upsert = _UPSERT.format(p="%s")
                cur.executemany(upsert, [c.params(w) for w, c in changes.items()])
            if payouts:
                cur.executemany(_JOURNAL.format(p="%s"), list(map(_journal_params, payouts)))

    def forget_payouts(self, scope: str, before_step: int) -> None:
        self._connected().execute(_FORGET.format(p="%s"), (scope, before_step))

    def close(self) -> None:
        self.db.close()


def open_store(where: str | Path) -> LedgerStore:
    """The store ``where`` names: a ``postgresql://`` URL, ``:memory:``, or a file path."""
    text = str(where)
    if text.startswith(("postgresql://", "postgres://")):
        return PostgresStore(text)
    if text == MEMORY:
        return MemoryStore()
    return SqliteStore(Path(where))
