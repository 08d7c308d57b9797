"""Earliest finish in assign(): exact tables with an explicit clock and hand-made
predictions (`SchedulerConfig.leave_for_faster`)."""

from __future__ import annotations

import pytest
from support.scheduler_tables import Table, ticket

from coordinator.schedule.scheduler import Assignment, Scheduler, SchedulerConfig

LEAVE = SchedulerConfig(heartbeat_timeout_s=10.0, tile_timeout_s=300.0, leave_for_faster=2.0)


def pairs(assignments: list[Assignment]) -> list[tuple[str, str]]:
    return [(a.worker_id, a.tile_id) for a in assignments]


# slow needs 10 s per tile, fast 1 s.
RUN = {"slow": 10.0, "fast": 1.0}


def fast_busy_slow_free() -> Scheduler:
    sched = Scheduler(LEAVE)
    sched.add_worker("fast", window=1, now=0.0)
    sched.add_worker("slow", window=1, now=0.0)
    sched.submit([ticket("t0")])
    assert pairs(sched.assign(0.0)) == [("fast", "t0")]
    sched.submit([ticket("t1"), ticket("t2")])
    return sched


def test_a_slow_worker_leaves_a_tile_for_a_fast_one_about_to_be_free() -> None:
    sched = fast_busy_slow_free()
    # At t=0 fast returns t0 at 1 s, then needs 1 s: t1 back in 2 s; slow would need
    # 10 s > 2 x 2: slow passes, t1 and t2 wait in the queue.
    assert sched.assign(0.0, Table({("fast", "t0"): 1.0}, RUN)) == []
    assert sched.queued_count() == 2
    sched.complete("fast", "t0", 1.0)
    # Fast is free at 1: it takes t1 (1 s); slow still passes t2 (10 s vs 1 s from now).
    got = sched.assign(1.0, Table({}, RUN))
    assert pairs(got) == [("fast", "t1")]
    # With fast busy until 2, t2 from fast lands at 2 s from now (1 + 1) and from slow
    # at 10 s: still more than twice as late, so it waits for fast.
    assert sched.assign(1.0, Table({("fast", "t1"): 2.0}, RUN)) == []


def test_within_the_ratio_the_free_worker_takes_it() -> None:
    sched = fast_busy_slow_free()
    # fast is stuck on t0 until 9: t1 from fast back at 10 s, from slow at 10 s too:
    # slow takes t1 now. t2 waits: both windows are full.
    finish = {("fast", "t0"): 9.0, ("slow", "t1"): 10.0}
    assert pairs(sched.assign(0.0, Table(finish, RUN))) == [("slow", "t1")]
    assert sched.queued_count() == 1


def test_off_without_predictions_or_for_reissued_tiles() -> None:
    sched = fast_busy_slow_free()
    # No predictions: the slot is filled as always.
    assert pairs(sched.assign(0.0)) == [("slow", "t1")]
    # A re-issued tile goes to whoever is free, however slow: slow drops t1 ...
    sched.remove_worker("slow", 0.5)
    sched.add_worker("slow", window=1, now=0.5)
    got = sched.assign(0.5, Table({("fast", "t0"): 1.0}, RUN))
    assert pairs(got) == [("slow", "t1")] and got[0].reissue
    # ... while the fresh t2 still waits for fast.
    assert sched.queued_count() == 1


def test_a_paused_fast_worker_does_not_hold_tiles_back() -> None:
    sched = fast_busy_slow_free()
    sched.set_paused("fast", True, 0.0)  # t0 goes back to the queue
    got = sched.assign(0.0, Table({}, RUN))
    assert pairs(got) == [("slow", "t0")]


def test_leave_for_faster_must_be_at_least_one() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(leave_for_faster=0.5)
