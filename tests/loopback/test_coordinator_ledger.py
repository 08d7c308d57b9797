"""The ledger of verified contributions: accumulation, durability, ordering, commits that
never hold up the event loop. One suite runs against every store (memory, a SQLite file,
PostgreSQL); the tests after it check what is particular to each."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from support.pg_cluster import fresh_database, postgres_url  # noqa: F401  (fixtures)

from coordinator.pool.ledger import Contribution, Ledger
from coordinator.pool.ledger_stores import LedgerStore, MemoryStore, RowChange
from coordinator.pool.payouts import Payout
from coordinator.schedule.records import TileTicket


def reject(ledger: Ledger, worker: str, now: float, reputation: float = 0.5, ban: str = "") -> None:
    ledger.reject(
        worker, name=f"{worker}-laptop", reputation=reputation, banned_reason=ban, now=now
    )


def credit(
    ledger: Ledger, worker: str, flops: int, now: float = 1.0, **kw: float | TileTicket
) -> int:
    return ledger.credit(
        worker,
        name=f"{worker}-laptop",
        reputation=float(kw.get("reputation", 1.0)),
        flops=flops,
        bytes_down=int(kw.get("down", 100)),
        bytes_up=int(kw.get("up", 10)),
        compute_s=float(kw.get("s", 0.5)),
        now=now,
        ticket=kw.get("ticket"),
    )


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> str | LedgerStore:
    """Where a ledger keeps its rows; ``Ledger(place)`` again reopens the same rows."""
    if request.param == "memory":
        return MemoryStore()
    if request.param == "sqlite":
        return str(tmp_path / "state" / "nested" / "ledger.sqlite")  # parents are created
    return str(request.getfixturevalue("fresh_database"))


@pytest.fixture
def ledger(place: str | LedgerStore) -> Iterator[Ledger]:
    led = Ledger(place)
    yield led
    led.close()


class _Commits:
    """A store whose commits are recorded, and held until the test lets them go."""

    def __init__(self, store: LedgerStore, hold: bool = False) -> None:
        self.store = store
        self.batches: list[dict[str, RowChange]] = []
        self.committing = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def rows(self) -> list[Contribution]:
        return self.store.rows()

    def payouts(self, scope: str) -> list[Payout]:
        return self.store.payouts(scope)

    def commit(self, changes: Mapping[str, RowChange], payouts: Sequence[Payout] = ()) -> None:
        self.committing.set()
        assert self.release.wait(30), "the test never released the commit"
        self.batches.append(dict(changes))
        self.store.commit(changes, payouts)

    def forget_payouts(self, scope: str, before_step: int) -> None:
        self.store.forget_payouts(scope, before_step)

    def close(self) -> None:
        self.store.close()


def _stored(place: str | LedgerStore) -> list[Contribution]:
    """The rows as committed, read by a ledger of their own."""
    led = Ledger(place)
    try:
        return led.all()
    finally:
        if not isinstance(place, MemoryStore):  # closing would not forget memory's rows
            led.store.close()


def _wrapped(place: str | LedgerStore, hold: bool = False) -> tuple[Ledger, _Commits]:
    probe = Ledger(place)
    commits = _Commits(probe.store, hold)
    return Ledger(commits), commits


def test_unknown_worker_has_an_empty_contribution(ledger: Ledger) -> None:
    assert ledger.get("nobody") == Contribution("nobody")
    assert ledger.all() == []


def test_reads_come_from_memory_never_from_the_store(place: str | LedgerStore) -> None:
    # Heartbeats read a worker's row on the event loop and /api/status lists them all:
    # none of that may wait on the store (behind a commit, or across the network).
    first = Ledger(place)
    credit(first, "alice", 7)
    reject(first, "mallory", now=2.0, ban="wrong results")
    first.close()
    led = Ledger(place)
    try:

        def no_reads() -> list[Contribution]:
            raise AssertionError("the store was read after the ledger opened")

        led.store.rows = no_reads  # type: ignore[method-assign]
        for _ in range(3):
            assert led.get("newcomer") == Contribution("newcomer")
        assert led.get("alice").flops == 7
        assert [c.worker for c in led.all()] == ["alice", "mallory"]
        assert [c.worker for c in led.banned()] == ["mallory"]
    finally:
        led.close()


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


def test_contributions_survive_reopening(place: str | LedgerStore) -> None:
    first = Ledger(place)
    credit(first, "alice", 7, down=1, up=2, s=3.0)
    reject(first, "bob", now=1.0)
    first.close()
    second = Ledger(place)
    try:
        assert second.get("alice") == Contribution("alice", "alice-laptop", 1, 7, 1, 2, 3.0, 0)
        credit(second, "alice", 3)
        assert second.get("alice").tiles == 2 and second.get("alice").flops == 10
        assert second.get("bob").rejected == 1
    finally:
        second.close()


def test_credits_are_committed_together_at_a_flush(place: str | LedgerStore) -> None:
    led, commits = _wrapped(place)
    try:
        credit(led, "alice", 42)
        credit(led, "alice", 8)
        reject(led, "mallory", now=2.0)
        assert led.queued == 3 and led.get("alice").tiles == 2  # memory first
        assert _stored(place) == []  # nothing in the store yet
        led.flush()
        assert led.queued == 0 and len(commits.batches) == 1
        stored = {c.worker: (c.tiles, c.flops, c.rejected) for c in _stored(place)}
        assert stored == {"alice": (2, 50, 0), "mallory": (0, 0, 1)}
    finally:
        led.close()


def test_credits_and_reads_do_not_wait_for_a_commit_in_progress(place: str | LedgerStore) -> None:
    led, commits = _wrapped(place, hold=True)
    credit(led, "alice", 42)
    flusher = threading.Thread(target=led.flush)
    flusher.start()
    try:
        assert commits.committing.wait(30)
        assert led.queued == 1  # taken from the queue, not yet committed
        # The event loop's calls, while the commit is held: each returns at once.
        during = threading.Thread(
            target=lambda: (credit(led, "alice", 8), led.get("alice"), led.all())
        )
        during.start()
        during.join(10)
        assert not during.is_alive(), "a credit or a read waited for the commit"
        assert led.get("alice").tiles == 2 and led.queued == 2
    finally:
        commits.release.set()
        flusher.join(30)
    assert led.queued == 1  # the second credit waits for the next flush
    led.flush()
    led.close()
    assert [(c.tiles, c.flops) for c in _stored(place)] == [(2, 50)]


def test_close_commits_what_is_queued(place: str | LedgerStore) -> None:
    led = Ledger(place)
    credit(led, "alice", 42)
    reject(led, "mallory", now=2.0, ban="wrong results")
    credit(led, "bob", 7)
    led.close()
    again = Ledger(place)
    try:
        assert again.get("bob").tiles == 1 and again.get("alice").flops == 42
        assert [c.worker for c in again.banned()] == ["mallory"]
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


def test_rows_in_memory_match_the_store(place: str | LedgerStore) -> None:
    led = Ledger(place)
    try:
        credit(led, "alice", 5, down=7, up=3, s=0.25)
        led.get("bob")  # a key with no row
        reject(led, "bob", now=1.0, reputation=0.5, ban="wrong results")
        credit(led, "alice", 6, reputation=0.9)
        credit(led, "bob", 1, reputation=0.51)
        in_memory = {key: led.get(key) for key in ("alice", "bob")}
    finally:
        led.close()
    fresh = Ledger(place)  # reads the store only
    try:
        assert {key: fresh.get(key) for key in ("alice", "bob")} == in_memory
        assert in_memory["alice"].tiles == 2 and in_memory["alice"].flops == 11
        assert (in_memory["bob"].tiles, in_memory["bob"].rejected) == (1, 1)
        assert in_memory["bob"].banned_at == 1.0
    finally:
        fresh.close()


def test_a_flush_writes_each_worker_once_with_all_its_credits_and_rejections(
    place: str | LedgerStore,
) -> None:
    led, commits = _wrapped(place)
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
    (batch,) = commits.batches
    assert sorted(batch) == ["alice", "bob"]
    assert (batch["alice"].first_seen, batch["alice"].last_seen) == (1.0, 61.0)
    rows = {c.worker: c for c in _stored(place)}
    assert rows["alice"] == Contribution(
        "alice", "alice-laptop", 51, 501, 5100, 510, 25.5, 1, 0.3, "wrong results", 60.0
    )
    assert rows["bob"] == Contribution("bob", "bob-laptop", 1, 7, 100, 10, 0.5, 0, 1.0)


def test_a_commit_lands_whole_or_not_at_all(place: str | LedgerStore) -> None:
    if isinstance(place, MemoryStore):
        pytest.skip("memory has no constraint to break")
    led = Ledger(place)
    credit(led, "alice", 5)
    led.flush()
    broken = RowChange(first_seen=1.0, tiles=1, flops=3)
    broken.name = None  # type: ignore[assignment]  # NOT NULL: the second change fails
    good = RowChange(first_seen=1.0, name="alice-laptop", tiles=1, flops=100)
    with pytest.raises(Exception):  # noqa: B017  (each driver raises its own kind)
        led.store.commit({"alice": good, "zed": broken})
    led.close()
    assert [(c.worker, c.flops) for c in _stored(place)] == [("alice", 5)]


def tile(gemm: str, index: str, flops: int, gemm_flops: int = 100) -> TileTicket:
    return TileTicket(f"{gemm}/{index}", gemm, flops, 8, 4, gemm_flops=gemm_flops)


def test_a_step_run_again_after_a_restart_pays_each_gemm_once(place: str | LedgerStore) -> None:
    first = [tile("s3:mm", f"0.{i}.0.0", 25) for i in range(4)]
    led = Ledger(place, scope="rank-0")
    assert [credit(led, "alice", 25, ticket=t) for t in first[:3]] == [25, 25, 25]
    led.close()  # committed: then the coordinator is killed mid-step
    again = Ledger(place, scope="rank-0")
    try:
        # The step runs again: its GEMM pays only what it still owed, to the first
        # tiles verified, however the planner cuts it this time.
        paid = [credit(again, "bob", 25, ticket=t, reputation=0.9) for t in first]
        assert paid == [25, 0, 0, 0]
        other = [tile("s3:mm", f"{i}.0.0.0", 50) for i in range(2)]
        assert [credit(again, "carol", 50, ticket=t, reputation=0.8) for t in other] == [0, 0]
        bob, carol = again.get("bob"), again.get("carol")
        assert (bob.tiles, bob.flops, bob.bytes_down, bob.reputation) == (1, 25, 100, 0.9)
        assert (carol.tiles, carol.flops, carol.bytes_up, carol.reputation) == (0, 0, 0, 0.8)
        # Another step, and tiles of no step (the load bench's) are paid in full.
        assert credit(again, "carol", 25, ticket=tile("s4:mm", "0.0.0.0", 25)) == 25
        assert credit(again, "carol", 9, ticket=tile("bench-7", "0.0.0.0", 9)) == 9
        assert credit(again, "carol", 9, ticket=tile("bench-7", "0.0.0.0", 9)) == 9
        assert credit(again, "carol", 7) == 7
    finally:
        again.close()
    rank1 = Ledger(place, scope="rank-1")  # another rank's steps: its own GEMMs
    try:
        assert credit(rank1, "dave", 25, ticket=first[0]) == 25
    finally:
        rank1.close()
    totals = {c.worker: c.flops for c in _stored(place)}
    assert totals == {"alice": 75, "bob": 25, "carol": 50, "dave": 25}


def test_a_checkpoint_forgets_the_payouts_of_the_steps_it_holds(place: str | LedgerStore) -> None:
    led = Ledger(place)
    for step in range(3):
        credit(led, "alice", 10, ticket=tile(f"s{step}:mm", "0.0.0.0", 10, 10))
    led.flush()
    led.checkpointed(2)  # steps 0 and 1 never run again
    led.close()
    again = Ledger(place)
    try:
        assert [p.step for p in again.store.payouts("")] == [2]
        assert credit(again, "alice", 10, ticket=tile("s2:mm", "0.0.0.0", 10, 10)) == 0
        again.start_over()  # --fresh: every step is new work
        assert again.store.payouts("") == []
        assert credit(again, "alice", 10, ticket=tile("s2:mm", "0.0.0.0", 10, 10)) == 10
    finally:
        again.close()
    assert [(c.tiles, c.flops) for c in _stored(place)] == [(4, 40)]


def test_credit_lost_with_its_commit_is_paid_when_the_step_runs_again(
    place: str | LedgerStore,
) -> None:
    led, commits = _wrapped(place, hold=True)
    credit(led, "alice", 10, ticket=tile("s0:mm", "0.0.0.0", 10, 10))
    flushing = threading.Thread(target=led.flush)
    flushing.start()
    assert commits.committing.wait(10)
    # Killed before the commit lands: neither the credit nor its payout is stored.
    again = Ledger(commits.store)
    assert credit(again, "alice", 10, ticket=tile("s0:mm", "0.0.0.0", 10, 10)) == 10
    commits.release.set()
    flushing.join()


# ---- what is particular to each store ----------------------------------------------------


def test_first_and_last_seen_in_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    credit(led, "alice", 1, now=10.0)
    credit(led, "alice", 1, now=20.0)
    reject(led, "alice", now=30.0)
    reject(led, "bob", now=5.0)
    led.close()
    with sqlite3.connect(path) as db:
        rows = {
            w: (f, la)
            for w, f, la in db.execute("SELECT worker, first_seen, last_seen FROM contributions")
        }
    assert rows == {"alice": (10.0, 30.0), "bob": (5.0, 5.0)}


def test_first_and_last_seen_in_postgresql(fresh_database: str) -> None:  # noqa: F811
    import psycopg

    led = Ledger(fresh_database)
    credit(led, "alice", 1, now=10.0)
    led.flush()
    credit(led, "alice", 1, now=20.0)
    reject(led, "alice", now=30.0)
    led.close()
    with psycopg.connect(fresh_database) as db:
        row: Any = db.execute(
            "SELECT first_seen, last_seen, flops FROM contributions WHERE worker = 'alice'"
        ).fetchone()
    assert tuple(row) == (10.0, 30.0, 2)


def test_flops_past_32_bits_in_postgresql(fresh_database: str) -> None:  # noqa: F811
    led = Ledger(fresh_database)
    credit(led, "alice", 3 * 10**15)  # a month of a fast GPU
    led.close()
    assert _stored(fresh_database)[0].flops == 3 * 10**15


def test_a_failed_commit_leaves_its_writes_for_the_next_in_order(
    place: str | LedgerStore,
) -> None:
    led, commits = _wrapped(place)
    store_commit = commits.commit

    def down(*args: Any) -> None:
        raise OSError("the store is down")

    try:
        first = [tile("s3:mm", f"0.{i}.0.0", 25) for i in range(4)]
        credit(led, "alice", 25, now=1.0, reputation=0.9, ticket=first[0])
        reject(led, "bob", now=2.0)
        commits.commit = down  # type: ignore[method-assign]
        with pytest.raises(OSError):
            led.flush()
        assert led.queued == 2
        credit(led, "alice", 25, now=3.0, reputation=0.8, ticket=first[1])
        reject(led, "bob", now=4.0, ban="wrong results")
        commits.commit = store_commit  # type: ignore[method-assign]
        led.flush()
        assert led.queued == 0
    finally:
        led.close()
    rows = {c.worker: c for c in _stored(place)}
    assert (rows["alice"].tiles, rows["alice"].flops, rows["alice"].reputation) == (2, 50, 0.8)
    assert (rows["bob"].rejected, rows["bob"].banned_at) == (2, 4.0)
    # The GEMM's payouts of both commits are journaled: run again, it owes 50 more.
    again = Ledger(place)
    try:
        assert [credit(again, "carol", 25, ticket=t) for t in first] == [25, 25, 0, 0]
    finally:
        again.close()


def test_a_postgresql_ledger_connects_again_after_its_connection_is_cut(
    fresh_database: str,  # noqa: F811
) -> None:
    # The database restarted, or a proxy dropped the connection: the commit under way
    # fails, and the next one reconnects and carries its writes.
    import psycopg

    led = Ledger(fresh_database)
    try:
        credit(led, "alice", 5)
        led.flush()
        with psycopg.connect(fresh_database, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        credit(led, "alice", 7)
        with pytest.raises(psycopg.OperationalError):
            led.flush()
        credit(led, "alice", 11)
        led.flush()
        assert led.queued == 0
    finally:
        led.close()
    assert [(c.tiles, c.flops) for c in _stored(fresh_database)] == [(3, 23)]
