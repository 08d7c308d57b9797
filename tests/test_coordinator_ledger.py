"""The SQLite ledger of verified contributions: accumulation, durability, WAL, ordering."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.pool.ledger import Contribution, Ledger


def reject(ledger: Ledger, worker: str, now: float, reputation: float = 0.5, ban: str = "") -> None:
    ledger.reject(
        worker, name=f"{worker}-laptop", reputation=reputation, banned_reason=ban, now=now
    )


def credit(ledger: Ledger, worker: str, flops: int, now: float = 1.0, **kw: float) -> None:
    ledger.credit(
        worker,
        name=f"{worker}-laptop",
        reputation=float(kw.get("reputation", 1.0)),
        flops=flops,
        bytes_down=int(kw.get("down", 100)),
        bytes_up=int(kw.get("up", 10)),
        compute_s=float(kw.get("s", 0.5)),
        now=now,
    )


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(tmp_path / "ledger.sqlite")
    yield led
    led.close()


def test_unknown_worker_has_an_empty_contribution(ledger: Ledger) -> None:
    assert ledger.get("nobody") == Contribution("nobody")
    assert ledger.all() == []


def test_a_worker_without_a_row_reads_the_file_once(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Heartbeats read the worker's row on the event loop: a worker with no verified
    # tile yet must not cost a SELECT (behind any commit) on every one of them.
    monkeypatch.setattr("coordinator.pool.ledger.ABSENT_REMEMBERED", 2)
    selects: list[str] = []
    ledger._db.set_trace_callback(lambda sql: selects.append(sql) if "SELECT" in sql else None)
    for _ in range(3):
        assert ledger.get("newcomer") == Contribution("newcomer")
    assert len(selects) == 1
    credit(ledger, "newcomer", 7)  # a credit makes the row, remembered or not
    assert ledger.get("newcomer").tiles == 1
    for stranger in ("s1", "s2", "s3"):  # past the bound the remembered keys are dropped
        ledger.get(stranger)
    ledger.get("s1")
    assert len(selects) == 5


def test_credits_and_rejections_accumulate(ledger: Ledger) -> None:
    credit(ledger, "alice", 1_000_000_000, down=300, up=30, s=0.25)
    credit(ledger, "alice", 500_000_000, down=200, up=20, s=0.5)
    reject(ledger, "alice", now=2.0)
    reject(ledger, "mallory", now=3.0)
    reject(ledger, "mallory", now=4.0, reputation=0.25)
    alice = ledger.get("alice")
    assert alice == Contribution("alice", "alice-laptop", 2, 1_500_000_000, 500, 50, 0.75, 1, 0.5)
    assert alice.gflop == pytest.approx(1.5)
    assert alice.to_json() == {
        "name": "alice-laptop",
        "tiles": 2,
        "gflop": 1.5,
        "bytes_down": 500,
        "bytes_up": 50,
        "compute_s": 0.75,
        "rejected": 1,
        "reputation": 0.5,
        "banned": "",
    }
    assert ledger.get("mallory") == Contribution(
        "mallory", "mallory-laptop", rejected=2, reputation=0.25
    )


def test_first_and_last_seen(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    credit(led, "alice", 1, now=10.0)
    credit(led, "alice", 1, now=20.0)
    reject(led, "alice", now=30.0)
    reject(led, "bob", now=5.0)
    led.close()
    with sqlite3.connect(path) as db:
        rows = dict(
            (w, (f, la))
            for w, f, la in db.execute("SELECT worker, first_seen, last_seen FROM contributions")
        )
    assert rows == {"alice": (10.0, 30.0), "bob": (5.0, 5.0)}


def test_contributions_survive_reopening_the_same_file(tmp_path: Path) -> None:
    path = tmp_path / "state" / "nested" / "ledger.sqlite"  # parents are created
    first = Ledger(path)
    credit(first, "alice", 7, down=1, up=2, s=3.0)
    reject(first, "bob", now=1.0)
    first.close()
    second = Ledger(path)
    try:
        assert second.get("alice") == Contribution("alice", "alice-laptop", 1, 7, 1, 2, 3.0, 0)
        credit(second, "alice", 3)
        assert second.get("alice").tiles == 2 and second.get("alice").flops == 10
        assert second.get("bob").rejected == 1
    finally:
        second.close()


def test_credits_are_committed_together_at_a_flush_and_visible_before_close(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    try:
        credit(led, "alice", 42)
        credit(led, "alice", 8)
        reject(led, "mallory", now=2.0)
        assert led.queued == 3 and led.get("alice").tiles == 2  # memory first
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT * FROM contributions").fetchall() == []
        led.flush()
        assert led.queued == 0
        with sqlite3.connect(path) as db:
            rows = db.execute("SELECT worker, tiles, flops, rejected FROM contributions")
            assert sorted(rows.fetchall()) == [("alice", 2, 50, 0), ("mallory", 0, 0, 1)]
    finally:
        led.close()


class _SlowCommits:
    """The ledger's connection, with each COMMIT held until the test lets it go."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.committing = threading.Event()
        self.release = threading.Event()

    def execute(self, sql: str, *params: object) -> sqlite3.Cursor:
        if sql == "COMMIT":
            self.committing.set()
            assert self.release.wait(30), "the test never released the commit"
        return self.db.execute(sql, *params)

    def close(self) -> None:
        self.db.close()


def test_credits_and_reads_do_not_wait_for_a_commit_in_progress(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    slow = _SlowCommits(led._db)
    led._db = slow  # type: ignore[assignment]
    credit(led, "alice", 42)
    flusher = threading.Thread(target=led.flush)
    flusher.start()
    try:
        assert slow.committing.wait(30)
        assert led.queued == 1  # taken from the queue, not yet committed
        # The event loop's calls, while the commit is held: each returns at once.
        during = threading.Thread(target=lambda: (credit(led, "alice", 8), led.get("alice")))
        during.start()
        during.join(10)
        assert not during.is_alive(), "a credit waited for the commit"
        assert led.get("alice").tiles == 2 and led.queued == 2
    finally:
        slow.release.set()
        flusher.join(30)
    assert led.queued == 1  # the second credit waits for the next flush
    led.flush()
    led.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT tiles, flops FROM contributions").fetchall() == [(2, 50)]


def test_reads_and_close_commit_what_is_queued(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    credit(led, "alice", 42)
    assert [c.tiles for c in led.all()] == [1] and led.queued == 0
    reject(led, "mallory", now=2.0, ban="wrong results")
    assert [c.worker for c in led.banned()] == ["mallory"] and led.queued == 0
    credit(led, "bob", 7)
    led.close()
    again = Ledger(path)
    try:
        assert again.get("bob").tiles == 1
    finally:
        again.close()


def test_wal_mode_is_on(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    Ledger(path).close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"


def test_all_is_ordered_by_flops_then_name(ledger: Ledger) -> None:
    credit(ledger, "carol", 50)
    credit(ledger, "bob", 100)
    credit(ledger, "alice", 50)
    credit(ledger, "dave", 10)
    credit(ledger, "dave", 45)  # 55 in all
    reject(ledger, "eve", now=1.0)  # no flops at all
    assert [c.worker for c in ledger.all()] == ["bob", "dave", "alice", "carol", "eve"]
    assert [c.flops for c in ledger.all()] == [100, 55, 50, 50, 0]


def test_concurrent_credits_from_many_threads_all_count(ledger: Ledger) -> None:
    def work(name: str) -> None:
        for _ in range(50):
            credit(ledger, name, 2)
            reject(ledger, name, now=1.0)

    threads = [threading.Thread(target=work, args=(f"w{i % 2}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    totals = {c.worker: (c.tiles, c.flops, c.rejected) for c in ledger.all()}
    assert totals == {"w0": (100, 200, 100), "w1": (100, 200, 100)}


def test_a_ban_is_kept_with_its_first_reason_and_time(ledger: Ledger) -> None:
    reject(ledger, "mallory", now=1.0, reputation=0.5)
    assert ledger.banned() == []
    reject(ledger, "mallory", now=2.0, reputation=0.1, ban="3 results failed verification")
    reject(ledger, "mallory", now=3.0, reputation=0.05, ban="a later reason")
    credit(ledger, "alice", 5)
    (banned,) = ledger.banned()
    assert (banned.worker, banned.name) == ("mallory", "mallory-laptop")
    assert banned.banned_reason == "3 results failed verification"
    assert banned.reputation == 0.05 and banned.rejected == 3
    assert banned.to_json()["banned"] == "3 results failed verification"


def test_a_ledger_from_before_keys_gains_the_new_columns(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with sqlite3.connect(path) as db:
        db.execute(
            """CREATE TABLE contributions (worker TEXT PRIMARY KEY,
               tiles INTEGER NOT NULL DEFAULT 0, flops INTEGER NOT NULL DEFAULT 0,
               bytes_down INTEGER NOT NULL DEFAULT 0, bytes_up INTEGER NOT NULL DEFAULT 0,
               compute_s REAL NOT NULL DEFAULT 0, rejected INTEGER NOT NULL DEFAULT 0,
               first_seen REAL, last_seen REAL)"""
        )
        db.execute("INSERT INTO contributions (worker, tiles, flops) VALUES ('old-name', 3, 9)")
    led = Ledger(path)
    try:
        old = led.get("old-name")
        assert (old.name, old.tiles, old.flops, old.reputation, old.banned_reason) == (
            "old-name",
            3,
            9,
            1.0,
            "",
        )
        assert old.key_fingerprint == "old-name"  # not a key: shown as it was
        credit(led, "ab" * 32, 1)
        assert led.get("ab" * 32).name == "ab" * 32 + "-laptop"
    finally:
        led.close()


def test_rows_read_from_memory_match_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    try:
        credit(led, "alice", 5, down=7, up=3, s=0.25)  # never read before this write
        led.get("bob")  # a key with no row: read, not remembered
        reject(led, "bob", now=1.0, reputation=0.5)
        credit(led, "alice", 6, reputation=0.9)
        credit(led, "bob", 1, reputation=0.51)
        in_memory = {key: led.get(key) for key in ("alice", "bob")}
    finally:
        led.close()
    fresh = Ledger(path)  # reads the file only
    try:
        assert {key: fresh.get(key) for key in ("alice", "bob")} == in_memory
        assert in_memory["alice"].tiles == 2 and in_memory["alice"].flops == 11
        assert (in_memory["bob"].tiles, in_memory["bob"].rejected) == (1, 1)
    finally:
        fresh.close()


def test_a_flush_writes_each_worker_once_with_all_its_credits_and_rejections(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    statements: list[str] = []
    led._db.set_trace_callback(statements.append)
    try:
        for i in range(50):
            credit(led, "alice", 10, now=1.0 + i, reputation=0.9, down=100, up=10, s=0.5)
        reject(led, "alice", now=60.0, reputation=0.4, ban="wrong results")
        credit(led, "alice", 1, now=61.0, reputation=0.3)
        credit(led, "bob", 7, now=2.0)
        assert led.queued == 53
        led.flush()
        assert led.queued == 0
    finally:
        led.close()
    assert sum(s.lstrip().startswith("INSERT") for s in statements) == 2
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT worker, tiles, flops, bytes_down, bytes_up, compute_s, rejected, reputation,"
            " banned_reason, banned_at, first_seen, last_seen FROM contributions ORDER BY worker"
        ).fetchall()
    assert rows == [
        ("alice", 51, 501, 5100, 510, 25.5, 1, 0.3, "wrong results", 60.0, 1.0, 61.0),
        ("bob", 1, 7, 100, 10, 0.5, 0, 1.0, "", None, 2.0, 2.0),
    ]
