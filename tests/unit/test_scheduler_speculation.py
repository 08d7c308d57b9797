"""Speculative copies: exact tables with an explicit clock and hand-made predictions."""

from __future__ import annotations

import pytest
from support.scheduler_tables import Table, ticket

from coordinator.schedule.scheduler import (
    Assignment,
    Completion,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
    Verdict,
)

SPECULATE = SchedulerConfig(heartbeat_timeout_s=10.0, tile_timeout_s=300.0, speculate_after=2.0)


def two_tiles_on_slow_and_fast() -> Scheduler:
    sched = Scheduler(SPECULATE)
    sched.add_worker("slow", window=1, now=0.0)
    sched.add_worker("fast", window=1, now=0.0)
    sched.submit([ticket("t0"), ticket("t1")])
    assert [(a.worker_id, a.tile_id) for a in sched.assign(0.0)] == [("slow", "t0"), ("fast", "t1")]
    return sched


def test_off_by_default() -> None:
    sched = Scheduler(SchedulerConfig())
    sched.add_worker("slow", window=1, now=0.0)
    sched.add_worker("idle", window=1, now=0.0)
    sched.submit([ticket("t0")])
    sched.assign(0.0)
    assert sched.speculate(1.0, Table({("slow", "t0"): 1e9}, {"idle": 1.0})) == []
    assert sched.stats.speculated == 0


def test_copy_goes_to_idle_worker_and_first_result_wins() -> None:
    sched = two_tiles_on_slow_and_fast()
    assert sched.complete("fast", "t1", 1.0) == Completion(Verdict.ACCEPTED)
    # slow returns t0 at 50 s; fast would need 3 s from now (t=1): 49 > 2 * 3, so copy.
    copies = sched.speculate(1.0, Table({("slow", "t0"): 50.0}, {"fast": 3.0}))
    assert copies == [Assignment("fast", "t0", 301.0, reissue=True)]
    assert sched.in_flight("fast") == frozenset({"t0"})
    assert sched.in_flight("slow") == frozenset({"t0"})
    assert sched.complete("fast", "t0", 4.0) == Completion(Verdict.ACCEPTED, cancel=("slow",))
    assert sched.complete("slow", "t0", 50.0) == Completion(Verdict.DUPLICATE)
    assert sched.stats == SchedulerStats(
        submitted=2, completed=2, reissued=1, duplicates=1, speculated=1
    )
    sched.check_invariants()


@pytest.mark.parametrize(
    ("holder_finish", "copied"),
    [
        (7.0, True),  # 6 s away > 2 * 2.5 s
        (6.0, False),  # 5 s away == 2 * 2.5 s: not worth the bytes
        (2.0, False),  # the holder is nearly done
    ],
)
def test_threshold_is_strict(holder_finish: float, copied: bool) -> None:
    sched = two_tiles_on_slow_and_fast()
    sched.complete("fast", "t1", 1.0)
    copies = sched.speculate(1.0, Table({("slow", "t0"): holder_finish}, {"fast": 2.5}))
    assert (copies != []) == copied


def test_latest_tile_first_and_fastest_idle_worker() -> None:
    sched = Scheduler(SPECULATE)
    for worker_id in ("a", "b"):
        sched.add_worker(worker_id, window=1, now=0.0)
    sched.submit([ticket("t0"), ticket("t1")])
    sched.assign(0.0)  # a: t0, b: t1
    sched.add_worker("idle1", window=1, now=1.0)
    sched.add_worker("idle2", window=1, now=1.0)
    finish = {("a", "t0"): 40.0, ("b", "t1"): 90.0}
    copies = sched.speculate(1.0, Table(finish, {"idle1": 5.0, "idle2": 4.0}))
    # t1 is the later one: it gets the faster idle worker; t0 the other.
    assert [(c.worker_id, c.tile_id) for c in copies] == [("idle2", "t1"), ("idle1", "t0")]
    assert sched.stats.speculated == 2
    sched.check_invariants()


def test_busy_capped_refused_and_max_holders_never_take_copies() -> None:
    config = SchedulerConfig(tile_timeout_s=300.0, speculate_after=2.0, max_holders=2)
    sched = Scheduler(config)
    sched.add_worker("slow", window=1, now=0.0)
    sched.submit([ticket("t0", wire=100)])
    sched.assign(0.0)
    sched.add_worker("small", window=1, now=0.0, mem_cap_bytes=99)  # cannot hold t0
    sched.add_worker("busy", window=2, now=0.0)
    sched.submit([ticket("t1")])
    sched.assign(0.0)  # t1 -> small? no: wire 100 > 99, so busy
    assert sched.in_flight("busy") == frozenset({"t1"})
    finish = {("slow", "t0"): 100.0, ("busy", "t1"): 100.0}
    assert sched.speculate(1.0, Table(finish, {"small": 1.0, "busy": 1.0})) == []
    sched.add_worker("refuser", window=1, now=1.0)
    sched.add_worker("copier", window=1, now=1.0)
    copies = sched.speculate(1.0, Table(finish, {"refuser": 1.0, "copier": 2.0}))
    # Both tiles are equally late; ties go by tile id, t0 first, to the faster worker.
    assert [(c.worker_id, c.tile_id) for c in copies] == [("refuser", "t0"), ("copier", "t1")]
    # Every tile now has max_holders holders: a third idle worker gets nothing.
    sched.add_worker("third", window=1, now=2.0)
    assert sched.speculate(2.0, Table({}, {"third": 0.1})) == []
    # A worker that refused a tile is never given a copy of it again.
    sched.remove_worker("third", 3.0)
    assert sched.reject("refuser", "t0", 3.0, reason="refused") is False
    sched.add_worker("fourth", window=1, now=3.0)
    copies = sched.speculate(3.0, Table({("slow", "t0"): 100.0}, {"refuser": 1.0, "fourth": 9.0}))
    assert [(c.worker_id, c.tile_id) for c in copies] == [("fourth", "t0")]
    sched.check_invariants()


def test_lost_holder_after_copy_does_not_requeue() -> None:
    sched = two_tiles_on_slow_and_fast()
    sched.complete("fast", "t1", 1.0)
    sched.speculate(1.0, Table({("slow", "t0"): 50.0}, {"fast": 3.0}))
    # The straggler drops: the copy is still live, so nothing goes back to the queue.
    assert sched.remove_worker("slow", 2.0) == []
    assert sched.queued_count() == 0
    assert sched.complete("fast", "t0", 4.0) == Completion(Verdict.ACCEPTED)
    sched.check_invariants()


def test_config_rejects_ratio_below_one() -> None:
    with pytest.raises(ValueError, match="speculate_after"):
        SchedulerConfig(speculate_after=0.5)
    with pytest.raises(ValueError, match="max_holders"):
        SchedulerConfig(max_holders=0)
