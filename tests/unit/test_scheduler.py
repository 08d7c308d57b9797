"""Scheduler: tile life cycle with an explicit fake clock (plain floats, no sleeping).

Unit tests pin each rule down; a hypothesis state machine and a seeded random simulation
drive long event sequences and check the invariants after every step.
"""

from __future__ import annotations

import dataclasses
import random
import time
import tracemalloc
from collections import Counter, defaultdict
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from support.scheduler_tables import Table

from common.limits import held_tiles_limit
from coordinator.schedule.scheduler import (
    Assignment,
    Completion,
    Expiry,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
    TileTicket,
    UnknownWorkerError,
    Verdict,
)
from coordinator.schedule.state import Largest, SchedulerState

CONFIG = SchedulerConfig(heartbeat_timeout_s=10.0, tile_timeout_s=30.0)


def ticket(
    tile_id: str, gemm_id: str = "g", down: int = 100, up: int = 10, flops: int = 1000
) -> TileTicket:
    return TileTicket(tile_id, gemm_id, flops=flops, down_bytes=down, up_bytes=up)


def tiles(*tile_ids: str, gemm_id: str = "g") -> list[TileTicket]:
    return [ticket(tile_id, gemm_id) for tile_id in tile_ids]


def scheduler(windows: dict[str, int], now: float = 0.0) -> Scheduler:
    s = Scheduler(CONFIG)
    for worker_id, window in windows.items():
        s.add_worker(worker_id, window=window, now=now)
    return s


def pairs(assignments: list[Assignment]) -> list[tuple[str, str]]:
    return [(a.worker_id, a.tile_id) for a in assignments]


def counts(assignments: list[Assignment]) -> dict[str, int]:
    return dict(Counter(a.worker_id for a in assignments))


# --- assignment: window, order, fairness ------------------------------------------------


@pytest.mark.parametrize(
    ("windows", "n_tiles", "expected"),
    [
        ({"w1": 4}, 3, {"w1": 3}),
        ({"w1": 2}, 5, {"w1": 2}),
        ({"w1": 4, "w2": 4}, 4, {"w1": 2, "w2": 2}),
        ({"w1": 1, "w2": 3}, 4, {"w1": 1, "w2": 3}),
        ({"w1": 2, "w2": 2, "w3": 2}, 5, {"w1": 2, "w2": 2, "w3": 1}),
        ({"w1": 3, "w2": 3}, 10, {"w1": 3, "w2": 3}),
    ],
)
def test_windows_and_round_robin(
    windows: dict[str, int], n_tiles: int, expected: dict[str, int]
) -> None:
    s = scheduler(windows)
    s.submit(tiles(*(f"t{i}" for i in range(n_tiles))))
    assignments = s.assign(now=1.0)
    assert counts(assignments) == expected
    assert s.queued_count() == n_tiles - len(assignments)
    for worker_id, window in windows.items():
        assert len(s.in_flight(worker_id)) <= window


def test_round_robin_is_one_slot_at_a_time_in_fifo_order() -> None:
    s = scheduler({"w1": 4, "w2": 4})
    s.submit(tiles("t1", "t2", "t3", "t4"))
    assert pairs(s.assign(now=0.0)) == [("w1", "t1"), ("w2", "t2"), ("w1", "t3"), ("w2", "t4")]


def test_assignment_fields() -> None:
    s = scheduler({"w1": 1})
    s.submit(tiles("t1"))
    assert s.assign(now=5.0) == [Assignment("w1", "t1", deadline=35.0, reissue=False)]


def test_free_slot_is_refilled_after_completion() -> None:
    s = scheduler({"w1": 2})
    s.submit(tiles("t1", "t2", "t3"))
    assert pairs(s.assign(now=0.0)) == [("w1", "t1"), ("w1", "t2")]
    assert s.assign(now=1.0) == []
    assert s.complete("w1", "t1", now=2.0).verdict is Verdict.ACCEPTED
    assert pairs(s.assign(now=2.0)) == [("w1", "t3")]
    assert s.in_flight("w1") == {"t2", "t3"}


SLOTTED = dataclasses.replace(CONFIG, slot_flops=4000)


def slotted(window: int, *tickets: TileTicket) -> Scheduler:
    s = Scheduler(SLOTTED)
    s.add_worker("w1", window=window, now=0.0)
    s.submit(list(tickets))
    return s


def test_small_tiles_share_slots_and_are_refilled_half_the_most_at_a_time() -> None:
    s = slotted(2, *(ticket(f"t{i}", flops=100) for i in range(20)))
    most = held_tiles_limit(2)
    assert len(s.assign(now=0.0)) == most  # a slot's worth would be 40 of them
    for i in range(most // 2 - 1):
        s.complete("w1", f"t{i}", now=1.0)
        assert s.assign(now=1.0) == []  # not yet: they go out together
    s.complete("w1", f"t{most // 2 - 1}", now=2.0)
    assert len(s.assign(now=2.0)) == most // 2
    s.check_invariants()


def test_small_tiles_go_to_each_worker_in_turns_of_a_refill() -> None:
    s = Scheduler(SLOTTED)
    for worker_id in ("w1", "w2"):
        s.add_worker(worker_id, window=2, now=0.0)
    s.submit([ticket(f"t{i}", flops=100) for i in range(12)])
    turn = held_tiles_limit(2) // 2
    assert [w for w, _ in pairs(s.assign(now=0.0))] == ["w1"] * turn + ["w2"] * turn + ["w1"] * 4
    s.check_invariants()


def test_tiles_of_a_slot_or_more_fill_the_window_one_slot_at_a_time() -> None:
    s = slotted(2, *(ticket(f"t{i}", flops=4000 * (1 + i % 2)) for i in range(6)))
    assert pairs(s.assign(now=0.0)) == [("w1", "t0"), ("w1", "t1")]
    s.complete("w1", "t0", now=1.0)
    assert pairs(s.assign(now=1.0)) == [("w1", "t2")]
    s.check_invariants()


def test_half_slot_tiles_fill_the_window_by_flops_and_come_back_a_slot_at_a_time() -> None:
    s = slotted(2, *(ticket(f"t{i}", flops=2000) for i in range(10)))
    assert len(s.assign(now=0.0)) == 4
    s.complete("w1", "t0", now=1.0)
    assert s.assign(now=1.0) == []
    s.complete("w1", "t1", now=1.0)
    assert pairs(s.assign(now=1.0)) == [("w1", "t4"), ("w1", "t5")]
    s.check_invariants()


def test_rotation_continues_across_calls() -> None:
    s = scheduler({"w1": 5, "w2": 5, "w3": 5})
    s.submit(tiles("t1"))
    s.submit(tiles("t2"))
    first = s.assign(now=0.0)
    s.submit(tiles("t3"))
    second = s.assign(now=0.0)
    s.submit(tiles("t4"))
    third = s.assign(now=0.0)
    assert [a.worker_id for a in first + second + third] == ["w1", "w2", "w3", "w1"]


def test_no_workers_no_assignments() -> None:
    s = Scheduler(CONFIG)
    s.submit(tiles("t1"))
    assert s.assign(now=0.0) == []
    assert s.queued_count() == 1 and s.pending() == 1


def test_submit_rejects_duplicate_ids_atomically() -> None:
    s = scheduler({"w1": 1})
    s.submit(tiles("t1"))
    with pytest.raises(ValueError, match="t1"):
        s.submit(tiles("t2", "t1"))
    with pytest.raises(ValueError, match="t3"):
        s.submit(tiles("t3", "t3"))
    assert s.pending() == 1  # neither batch was partly queued
    s.assign(now=0.0)
    s.complete("w1", "t1", now=1.0)
    with pytest.raises(ValueError, match="t1"):
        s.submit(tiles("t1"))  # done tiles are still known until their GEMM is forgotten


def test_worker_registration_errors() -> None:
    s = scheduler({"w1": 1})
    with pytest.raises(ValueError, match="already registered"):
        s.add_worker("w1", window=1, now=0.0)
    with pytest.raises(ValueError, match="window"):
        s.add_worker("w2", window=0, now=0.0)
    with pytest.raises(UnknownWorkerError):
        s.heartbeat("nobody", now=0.0)
    with pytest.raises(UnknownWorkerError):
        s.set_paused("nobody", True, now=0.0)
    assert s.remove_worker("nobody", now=0.0) == []
    assert s.in_flight("nobody") == frozenset()
    assert s.workers() == ["w1"]


# --- losing tiles: disconnect, heartbeats, deadlines ------------------------------------


def test_disconnect_requeues_exactly_the_in_flight_tiles_at_the_front() -> None:
    s = scheduler({"w1": 2, "w2": 1})
    s.submit(tiles("t1", "t2", "t3", "t4"))
    assert pairs(s.assign(now=0.0)) == [("w1", "t1"), ("w2", "t2"), ("w1", "t3")]
    assert s.remove_worker("w1", now=1.0) == ["t1", "t3"]
    assert s.workers() == ["w2"]
    assert s.queued_count() == 3
    s.add_worker("w3", window=3, now=1.0)
    assert s.assign(now=2.0) == [
        Assignment("w3", "t1", deadline=32.0, reissue=True),
        Assignment("w3", "t3", deadline=32.0, reissue=True),
        Assignment("w3", "t4", deadline=32.0, reissue=False),
    ]
    assert s.stats.reissued == 2


def test_disconnect_keeps_tiles_another_worker_holds_in_time() -> None:
    s = scheduler({"w1": 1, "w2": 1})
    s.submit(tiles("t1"))
    s.assign(now=0.0)  # w1 takes t1
    s.heartbeat("w1", now=31.0)
    s.heartbeat("w2", now=31.0)
    assert s.expire(now=31.0).requeued == ("t1",)  # w1 is late: t1 queued again...
    assert pairs(s.assign(now=31.0)) == [("w2", "t1")]  # ...and w2 takes a copy
    assert s.remove_worker("w2", now=32.0) == ["t1"]  # w1 is overdue: t1 goes back
    s.add_worker("w3", window=1, now=32.0)
    assert pairs(s.assign(now=32.0)) == [("w3", "t1")]
    assert s.remove_worker("w1", now=33.0) == []  # w3 holds t1 in time


@pytest.mark.parametrize(
    ("heartbeat_at", "expire_at", "dead"),
    [
        (None, 10.0, ()),  # exactly at the timeout: still alive
        (None, 10.5, ("w1",)),
        (5.0, 10.5, ()),
        (5.0, 15.5, ("w1",)),
    ],
)
def test_heartbeat_timeout(heartbeat_at: float | None, expire_at: float, dead: tuple[str]) -> None:
    s = scheduler({"w1": 2})
    s.submit(tiles("t1"))
    s.assign(now=0.0)
    if heartbeat_at is not None:
        s.heartbeat("w1", now=heartbeat_at)
    expiry = s.expire(now=expire_at)
    assert expiry.dead_workers == dead
    assert expiry.requeued == (("t1",) if dead else ())
    assert s.workers() == ([] if dead else ["w1"])


def test_expire_reports_dead_workers_in_order_of_silence() -> None:
    s = scheduler({"w1": 1, "w2": 1, "w3": 1})
    s.submit(tiles("t1", "t2", "t3"))
    s.assign(now=0.0)
    s.heartbeat("w1", now=4.0)
    s.heartbeat("w3", now=2.0)
    s.heartbeat("w2", now=20.0)
    assert s.expire(now=20.0) == Expiry(dead_workers=("w3", "w1"), requeued=("t3", "t1"))
    assert s.expire(now=20.0) == Expiry()


def test_results_and_messages_count_as_liveness() -> None:
    s = scheduler({"w1": 2})
    s.submit(tiles("t1", "t2"))
    s.assign(now=0.0)
    s.complete("w1", "t1", now=8.0)
    assert s.expire(now=17.0).dead_workers == ()
    assert s.expire(now=18.5).dead_workers == ("w1",)


def test_deadline_requeue_original_holder_can_still_win() -> None:
    s = scheduler({"w1": 1})
    s.submit(tiles("t1"))
    assert pairs(s.assign(now=0.0)) == [("w1", "t1")]
    s.heartbeat("w1", now=30.0)
    assert s.expire(now=30.0) == Expiry()  # the deadline itself is still in time
    s.heartbeat("w1", now=30.5)
    s.add_worker("w2", window=1, now=30.5)
    assert s.expire(now=30.5) == Expiry(requeued=("t1",))
    assert s.assign(now=30.5) == [Assignment("w2", "t1", deadline=60.5, reissue=True)]
    assert s.in_flight("w1") == {"t1"}  # the straggler keeps it (and its window slot)
    assert s.complete("w1", "t1", now=31.0) == Completion(Verdict.ACCEPTED, cancel=("w2",))
    assert s.in_flight("w1") == frozenset() and s.in_flight("w2") == frozenset()
    assert s.complete("w2", "t1", now=32.0) == Completion(Verdict.DUPLICATE)
    assert s.stats == SchedulerStats(submitted=1, completed=1, reissued=1, rejected=0, duplicates=1)


def test_deadline_requeue_when_the_new_holder_wins() -> None:
    s = scheduler({"w1": 1, "w2": 1})
    s.submit(tiles("t1", "t2"))
    s.assign(now=0.0)  # w1: t1, w2: t2
    s.complete("w2", "t2", now=5.0)
    s.heartbeat("w1", now=31.0)
    s.heartbeat("w2", now=31.0)
    assert s.expire(now=31.0).requeued == ("t1",)
    assert pairs(s.assign(now=31.0)) == [("w2", "t1")]
    assert s.complete("w2", "t1", now=32.0) == Completion(Verdict.ACCEPTED, cancel=("w1",))
    assert s.complete("w1", "t1", now=33.0).verdict is Verdict.DUPLICATE


def test_overdue_tile_is_not_given_back_to_its_holder() -> None:
    s = scheduler({"w1": 2})
    s.submit(tiles("t1"))
    s.assign(now=0.0)
    s.heartbeat("w1", now=31.0)
    s.expire(now=31.0)
    assert s.assign(now=31.0) == []  # w1 still holds it; nobody else is there
    assert s.queued_count() == 1


def test_a_tile_is_requeued_once_however_many_holders_are_overdue() -> None:
    s = scheduler({"w1": 1, "w2": 1, "w3": 1})
    s.submit(tiles("t1"))
    s.assign(now=0.0)
    for w in ("w1", "w2", "w3"):
        s.heartbeat(w, now=31.0)
    s.expire(now=31.0)
    s.assign(now=31.0)  # w2 takes a copy
    for w in ("w1", "w2", "w3"):
        s.heartbeat(w, now=62.0)
    assert s.expire(now=62.0).requeued == ("t1",)
    assert s.queued_count() == 1
    assert pairs(s.assign(now=62.0)) == [("w3", "t1")]


# --- refusals and failed verification ---------------------------------------------------


def test_rejected_tile_goes_to_the_front_and_never_back_to_that_worker() -> None:
    s = scheduler({"w1": 1})
    s.submit(tiles("t1", "t2"))
    assert pairs(s.assign(now=0.0)) == [("w1", "t1")]
    assert s.reject("w1", "t1", now=1.0, reason="bad signature") is True
    assert s.in_flight("w1") == frozenset()
    # t1 is at the front, but w1 may not have it: it gets t2, and t1 waits.
    assert pairs(s.assign(now=1.0)) == [("w1", "t2")]
    s.complete("w1", "t2", now=2.0)
    assert s.assign(now=2.0) == []
    assert s.queued_count() == 1
    s.add_worker("w2", window=1, now=2.0)
    assert s.assign(now=2.0) == [Assignment("w2", "t1", deadline=32.0, reissue=True)]
    assert s.stats.rejected == 1


def test_rejected_tile_jumps_the_queue() -> None:
    s = scheduler({"w1": 1, "w2": 1})
    s.submit(tiles("t1", "t2", "t3"))
    s.assign(now=0.0)  # w1: t1, w2: t2
    s.reject("w1", "t1", now=1.0, reason="failed verification")
    s.complete("w2", "t2", now=1.0)
    assert pairs(s.assign(now=1.0)) == [("w2", "t1"), ("w1", "t3")]


@pytest.mark.parametrize(
    ("worker_id", "tile_id"),
    [("w1", "unknown"), ("nobody", "t1"), ("w2", "t1")],
)
def test_reject_from_a_non_holder_does_nothing(worker_id: str, tile_id: str) -> None:
    s = scheduler({"w1": 1, "w2": 1})
    s.submit(tiles("t1"))
    s.assign(now=0.0)
    assert s.reject(worker_id, tile_id, now=1.0, reason="x") is False
    assert s.in_flight("w1") == {"t1"}
    assert s.stats.rejected == 0


def test_reject_while_another_holder_is_in_time_keeps_that_holder() -> None:
    s = scheduler({"w1": 1, "w2": 1})
    s.submit(tiles("t1"))
    s.assign(now=0.0)
    s.heartbeat("w1", now=31.0)
    s.heartbeat("w2", now=31.0)
    s.expire(now=31.0)
    s.assign(now=31.0)  # w2 takes a copy of the overdue t1
    assert s.reject("w2", "t1", now=32.0, reason="failed verification") is True  # w1 is late
    assert s.assign(now=32.0) == []  # w1 holds it, w2 refused it
    assert s.complete("w1", "t1", now=33.0) == Completion(Verdict.ACCEPTED)


# --- pausing ----------------------------------------------------------------------------


def test_paused_worker_gets_nothing_and_gives_its_tiles_back() -> None:
    s = scheduler({"w1": 2, "w2": 2})
    s.submit(tiles("t1", "t2", "t3", "t4"))
    s.assign(now=0.0)  # w1: t1 t3, w2: t2 t4
    assert s.set_paused("w1", True, now=1.0) == ["t1", "t3"]
    assert s.set_paused("w1", True, now=1.0) == []  # already paused
    assert s.in_flight("w1") == frozenset()
    assert s.assign(now=1.0) == []  # w2 is full, w1 paused
    s.complete("w2", "t2", now=2.0)
    assert pairs(s.assign(now=2.0)) == [("w2", "t1")]
    assert s.set_paused("w1", False, now=3.0) == []
    assert pairs(s.assign(now=3.0)) == [("w1", "t3")]


def test_result_already_on_its_way_when_pausing_still_counts() -> None:
    s = scheduler({"w1": 1, "w2": 1})
    s.submit(tiles("t1"))
    s.assign(now=0.0)
    s.set_paused("w1", True, now=1.0)
    s.assign(now=1.0)  # w2 takes t1
    assert s.complete("w1", "t1", now=2.0) == Completion(Verdict.ACCEPTED, cancel=("w2",))
    assert s.complete("w2", "t1", now=3.0).verdict is Verdict.DUPLICATE


# --- memory caps ------------------------------------------------------------------------


def test_memory_cap_skips_big_tiles_without_blocking_the_queue() -> None:
    s = Scheduler(CONFIG)
    s.add_worker("small", window=2, now=0.0, mem_cap_bytes=150)
    s.submit([ticket("big", down=200), ticket("t2"), ticket("t3"), ticket("t4")])
    assert pairs(s.assign(now=0.0)) == [("small", "t2"), ("small", "t3")]
    assert s.queued_count() == 2
    s.add_worker("large", window=1, now=0.0, mem_cap_bytes=1000)
    assert pairs(s.assign(now=0.0)) == [("large", "big")]  # it kept its place in line


def test_memory_cap_counts_operands_and_result() -> None:
    s = Scheduler(CONFIG)
    s.add_worker("w1", window=4, now=0.0, mem_cap_bytes=110)
    s.submit([ticket("fits", down=100, up=10), ticket("over", down=100, up=11)])
    assert pairs(s.assign(now=0.0)) == [("w1", "fits")]


# --- verdicts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("worker_id", "tile_id", "verdict"),
    [
        ("w2", "t1", Verdict.ACCEPTED),
        ("w1", "t1", Verdict.NOT_ASSIGNED),  # known worker, not its tile
        ("w1", "t2", Verdict.NOT_ASSIGNED),  # queued, never assigned
        ("w2", "nope", Verdict.NOT_ASSIGNED),  # unknown tile
        ("ghost", "t1", Verdict.NOT_ASSIGNED),  # unknown worker
        ("w1", "done", Verdict.DUPLICATE),
        ("w2", "done", Verdict.DUPLICATE),  # done tiles are duplicates for anyone
        ("ghost", "done", Verdict.DUPLICATE),
    ],
)
def test_verdicts(worker_id: str, tile_id: str, verdict: Verdict) -> None:
    s = scheduler({"w1": 1, "w2": 1})
    s.submit(tiles("done", "t1", "t2"))
    assert pairs(s.assign(now=0.0)) == [("w1", "done"), ("w2", "t1")]
    s.complete("w1", "done", now=0.0)
    completion = s.complete(worker_id, tile_id, now=1.0)
    assert completion == Completion(verdict)
    assert s.stats.duplicates == (verdict is Verdict.DUPLICATE)
    s.check_invariants()


def test_removed_worker_never_wins() -> None:
    s = scheduler({"w1": 1, "w2": 1})
    s.submit(tiles("t1", "t2"))
    s.assign(now=0.0)  # w1: t1, w2: t2
    s.remove_worker("w1", now=1.0)
    assert s.complete("w1", "t1", now=2.0).verdict is Verdict.NOT_ASSIGNED
    s.expire(now=15.0)  # w2 times out too
    assert s.complete("w2", "t2", now=15.0).verdict is Verdict.NOT_ASSIGNED
    s.add_worker("w3", window=2, now=15.0)
    s.assign(now=15.0)
    s.complete("w3", "t1", now=16.0)
    assert s.complete("w1", "t1", now=17.0).verdict is Verdict.DUPLICATE
    # The same id joining again is a new worker: the old assignment does not carry over.
    s.add_worker("w2", window=1, now=17.0)
    assert s.complete("w2", "t2", now=17.0).verdict is Verdict.NOT_ASSIGNED


def test_completed_tile_leaves_queue_and_in_flight() -> None:
    s = scheduler({"w1": 1})
    s.submit(tiles("t1"))
    s.assign(now=0.0)
    s.heartbeat("w1", now=31.0)
    s.expire(now=31.0)
    assert s.queued_count() == 1
    s.complete("w1", "t1", now=31.0)
    assert (s.queued_count(), s.pending(), s.is_done("t1")) == (0, 0, True)
    s.add_worker("w2", window=1, now=31.0)
    assert s.assign(now=31.0) == []
    s.check_invariants()


# --- forgetting a GEMM ------------------------------------------------------------------


def test_forget_gemm_drops_queued_in_flight_and_done_tiles() -> None:
    s = scheduler({"w1": 2})
    s.submit(tiles("a1", "a2", "a3", "a4", gemm_id="a"))
    s.submit(tiles("b1", gemm_id="b"))
    s.assign(now=0.0)  # w1: a1 a2
    s.complete("w1", "a1", now=1.0)
    s.assign(now=1.0)  # w1: a2 a3
    assert s.forget_gemm("a") == [("w1", "a2"), ("w1", "a3")]
    assert s.in_flight("w1") == frozenset()
    assert (s.pending(), s.queued_count(), s.is_done("a1")) == (1, 1, False)
    # A result that crossed the cancel is a harmless duplicate; one for a tile it never had
    # is not.
    assert s.complete("w1", "a2", now=2.0).verdict is Verdict.DUPLICATE
    assert s.complete("w1", "a4", now=2.0).verdict is Verdict.NOT_ASSIGNED
    assert pairs(s.assign(now=2.0)) == [("w1", "b1")]
    assert s.forget_gemm("a") == []
    s.submit(tiles("a1", gemm_id="a"))  # ids are free again
    s.check_invariants()


def test_resubmitted_tile_after_forget_can_be_won_again() -> None:
    s = scheduler({"w1": 1})
    s.submit(tiles("t1"))
    s.assign(now=0.0)
    s.forget_gemm("g")
    s.submit(tiles("t1"))
    s.assign(now=1.0)
    assert s.complete("w1", "t1", now=2.0).verdict is Verdict.ACCEPTED


# --- performance sanity -----------------------------------------------------------------


def test_assign_scales_to_a_thousand_workers() -> None:
    s = Scheduler(CONFIG)
    for i in range(1000):
        s.add_worker(f"w{i}", window=10, now=0.0, mem_cap_bytes=None if i % 2 else 10_000)
    s.submit(ticket(f"t{i}") for i in range(10_000))
    started = time.perf_counter()
    assignments = s.assign(now=1.0)
    elapsed = time.perf_counter() - started
    assert len(assignments) == 10_000
    assert set(counts(assignments).values()) == {10}
    assert elapsed < 2.0  # a sanity bound, not a benchmark (~20 ms here)
    s.submit(ticket(f"u{i}") for i in range(10_000))
    started = time.perf_counter()
    for a in assignments:
        s.complete(a.worker_id, a.tile_id, now=2.0)
    assert len(s.assign(now=2.0)) == 10_000
    assert s.expire(now=3.0) == Expiry()
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize("preferences", [False, True])
def test_a_tile_goes_out_without_a_walk_over_every_free_worker(preferences: bool) -> None:
    # A large pool has more free slots than queued tiles: each verified result frees a
    # slot and the next tile goes out, one assign call per result. A call that walks
    # every free worker costs the coordinator more per tile the more volunteers join;
    # such a walk shows as memory allocated in proportion to them.
    s = Scheduler(CONFIG)
    for i in range(20_000):
        s.add_worker(f"w{i}", window=2, now=0.0)
    table = Table(holds=(lambda worker_id, t: False) if preferences else None)
    s.submit([ticket("first")])
    held = s.assign(1.0, table, timed=False)  # type: ignore[arg-type]  # learns the caps, once
    peaks = []
    tracemalloc.start()
    try:
        for i in range(200):
            s.submit([ticket(f"t{i}")])
            if i % 3 == 2:  # a result back: its worker has a free slot again
                done = held.pop(0)
                s.complete(done.worker_id, done.tile_id, now=1.0)
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            held += s.assign(1.0, table, timed=False)  # type: ignore[arg-type]
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()
    assert len(held) == 201 - 200 // 3
    assert max(peaks) < 16 << 10  # a walk over 20,000 workers allocates ~1 MB
    s.check_invariants()


# --- randomized: invariants over long event sequences -----------------------------------


class Model:
    """What the tests know independently of the scheduler, and checks against it."""

    def __init__(self, config: SchedulerConfig = CONFIG) -> None:
        self.s = Scheduler(config)
        self.config = config
        self.now = 0.0
        self.windows: dict[str, int] = {}
        self.caps: dict[str, int | None] = {}
        self.paused: set[str] = set()
        self.removed: set[str] = set()
        self.submitted: dict[str, TileTicket] = {}
        self.accepted: set[str] = set()
        self.forgotten: set[str] = set()
        self.refused: defaultdict[str, set[str]] = defaultdict(set)
        self.assigned_before: set[str] = set()
        self.serial = 0

    def new_id(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}{self.serial}"

    def add_worker(self, window: int, capped: bool) -> None:
        worker_id = self.new_id("w")
        cap = 150 if capped else None
        self.s.add_worker(worker_id, window=window, now=self.now, mem_cap_bytes=cap)
        self.windows[worker_id] = window
        self.caps[worker_id] = cap

    def forget_worker(self, worker_id: str) -> None:
        del self.windows[worker_id]
        self.paused.discard(worker_id)
        self.removed.add(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        held = self.s.in_flight(worker_id)
        assert set(self.s.remove_worker(worker_id, self.now)) <= held
        self.forget_worker(worker_id)

    def submit(self, n: int, gemm_id: str, down: int, flops: int = 1000) -> None:
        batch = [ticket(self.new_id("t"), gemm_id, down=down, flops=flops) for _ in range(n)]
        self.s.submit(batch)
        self.submitted.update((t.tile_id, t) for t in batch)

    def assign(self) -> list[Assignment]:
        assignments = self.s.assign(self.now)
        for a in assignments:
            assert a.worker_id in self.windows and a.worker_id not in self.paused
            assert a.worker_id not in self.refused[a.tile_id]
            cap = self.caps[a.worker_id]
            assert cap is None or self.submitted[a.tile_id].wire_bytes <= cap
            assert a.tile_id not in self.accepted and a.tile_id not in self.forgotten
            assert a.deadline == self.now + CONFIG.tile_timeout_s
            assert a.reissue == (a.tile_id in self.assigned_before)
            self.assigned_before.add(a.tile_id)
        return assignments

    def complete(self, worker_id: str, tile_id: str) -> Completion:
        held = tile_id in self.s.in_flight(worker_id)
        completion = self.s.complete(worker_id, tile_id, self.now)
        if held:
            assert completion.verdict is Verdict.ACCEPTED
        if completion.verdict is Verdict.ACCEPTED:
            assert worker_id in self.windows, "a removed worker won"
            assert tile_id not in self.accepted, "a tile was accepted twice"
            assert set(completion.cancel) <= set(self.windows) - {worker_id}
            self.accepted.add(tile_id)
        else:
            assert completion.cancel == ()
        return completion

    def reject(self, worker_id: str, tile_id: str) -> None:
        if self.s.reject(worker_id, tile_id, self.now, reason="test"):
            assert self.s.queued_count() > 0
        self.refused[tile_id].add(worker_id)

    def set_paused(self, worker_id: str, paused: bool) -> None:
        requeued = self.s.set_paused(worker_id, paused, self.now)
        if paused:
            self.paused.add(worker_id)
            assert self.s.in_flight(worker_id) == frozenset()
        else:
            self.paused.discard(worker_id)
            assert requeued == []

    def expire(self) -> None:
        expiry = self.s.expire(self.now)
        for worker_id in expiry.dead_workers:
            self.forget_worker(worker_id)

    def forget_gemm(self, gemm_id: str) -> None:
        for worker_id, _ in self.s.forget_gemm(gemm_id):
            assert worker_id in self.windows
        self.forgotten |= {
            tile_id
            for tile_id, t in self.submitted.items()
            if t.gemm_id == gemm_id and tile_id not in self.accepted
        }

    def check(self) -> None:
        self.s.check_invariants()
        assert set(self.s.workers()) == set(self.windows)
        for worker_id, window in self.windows.items():
            held = self.s.in_flight(worker_id)
            assert len(held) <= (held_tiles_limit(window) if self.config.slot_flops else window)
            assert not (held & (self.accepted | self.forgotten))
            if worker_id in self.paused:
                assert not held
        for worker_id in self.removed:
            assert self.s.in_flight(worker_id) == frozenset()
        outstanding = set(self.submitted) - self.accepted - self.forgotten
        assert self.s.pending() == len(outstanding)
        assert self.s.queued_count() <= len(outstanding)
        assert self.s.stats.completed == len(self.accepted)

    def drain(self) -> None:
        """Everyone leaves; one fresh worker finishes every tile that is left, once."""
        for worker_id in list(self.windows):
            self.remove_worker(worker_id)
        self.s.add_worker("drain", window=10_000, now=self.now)
        self.windows["drain"] = 10_000
        self.caps["drain"] = None
        for a in self.assign():
            assert self.complete("drain", a.tile_id).verdict is Verdict.ACCEPTED
        self.check()
        assert self.s.pending() == 0
        assert self.accepted == set(self.submitted) - self.forgotten


def pick(items: set[str] | dict[str, int] | frozenset[str], index: int) -> str:
    ordered = sorted(items)
    return ordered[index % len(ordered)]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.m = Model()

    @rule(window=st.integers(1, 3), capped=st.booleans())
    def add_worker(self, window: int, capped: bool) -> None:
        self.m.add_worker(window, capped)

    @rule(i=st.integers(0, 99))
    def remove_worker(self, i: int) -> None:
        if self.m.windows:
            self.m.remove_worker(pick(self.m.windows, i))

    @rule(i=st.integers(0, 99))
    def heartbeat(self, i: int) -> None:
        if self.m.windows:
            self.m.s.heartbeat(pick(self.m.windows, i), self.m.now)

    @rule(dt=st.sampled_from([0.5, 4.0, 11.0, 31.0]))
    def advance(self, dt: float) -> None:
        self.m.now += dt

    @rule(n=st.integers(1, 4), gemm_id=st.sampled_from("abc"), down=st.sampled_from([50, 200]))
    def submit(self, n: int, gemm_id: str, down: int) -> None:
        self.m.submit(n, gemm_id, down)

    @rule()
    def assign(self) -> None:
        self.m.assign()

    @rule(i=st.integers(0, 99), j=st.integers(0, 99))
    def complete_held(self, i: int, j: int) -> None:
        busy = {w for w in self.m.windows if self.m.s.in_flight(w)}
        if busy:
            worker_id = pick(busy, i)
            self.m.complete(worker_id, pick(self.m.s.in_flight(worker_id), j))

    @rule(i=st.integers(0, 99), j=st.integers(0, 99))
    def complete_any(self, i: int, j: int) -> None:
        everyone = set(self.m.windows) | self.m.removed
        if everyone and self.m.submitted:
            self.m.complete(pick(everyone, i), pick(set(self.m.submitted), j))

    @rule(i=st.integers(0, 99), j=st.integers(0, 99))
    def reject_held(self, i: int, j: int) -> None:
        busy = {w for w in self.m.windows if self.m.s.in_flight(w)}
        if busy:
            worker_id = pick(busy, i)
            self.m.reject(worker_id, pick(self.m.s.in_flight(worker_id), j))

    @rule(i=st.integers(0, 99), paused=st.booleans())
    def set_paused(self, i: int, paused: bool) -> None:
        if self.m.windows:
            self.m.set_paused(pick(self.m.windows, i), paused)

    @rule()
    def expire(self) -> None:
        self.m.expire()

    @rule(gemm_id=st.sampled_from("abc"))
    def forget_gemm(self, gemm_id: str) -> None:
        self.m.forget_gemm(gemm_id)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "m"):
            self.m.check()

    def teardown(self) -> None:
        if hasattr(self, "m"):
            self.m.drain()


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
TestSchedulerMachine = SchedulerMachine.TestCase


@pytest.mark.parametrize("slot_flops", [None, 4000])
@pytest.mark.parametrize("seed", range(4))
def test_random_simulation_finishes_every_tile_once(seed: int, slot_flops: int | None) -> None:
    """A long run with fast and slow, reliable and flaky workers.

    Slow workers miss deadlines (copies, cancels, duplicates); flaky ones miss heartbeats
    and are dropped, and their late results must never win. With ``slot_flops``, tiles
    of several sizes share window slots.
    """
    rng = random.Random(seed)
    m = Model(dataclasses.replace(CONFIG, slot_flops=slot_flops))
    speed: dict[str, float] = {}  # chance per step to finish each tile it holds
    reliability: dict[str, float] = {}  # chance per step to send a heartbeat
    late: list[tuple[str, str]] = []  # results still on their way from removed workers

    def join() -> None:
        m.add_worker(rng.randint(1, 4), capped=rng.random() < 0.3)
        worker_id = f"w{m.serial}"
        speed[worker_id] = rng.choice([0.01, 0.2, 0.5])
        reliability[worker_id] = rng.choice([0.6, 0.99, 1.0])

    for _ in range(5):
        join()
    for step in range(2000):
        m.now += rng.choice([0.5, 1.0, 2.0])
        roll = rng.random()
        if roll < 0.01 or not m.windows:
            join()
        elif roll < 0.015:
            worker_id = rng.choice(sorted(m.windows))
            late.extend((worker_id, tile_id) for tile_id in m.s.in_flight(worker_id))
            m.remove_worker(worker_id)
        elif roll < 0.03:
            m.set_paused(rng.choice(sorted(m.windows)), rng.random() < 0.6)
        elif roll < 0.2:
            flops = rng.choice([100, 1000, 8000])
            m.submit(rng.randint(1, 6), rng.choice("abcdef"), rng.choice([50, 100, 200]), flops)
        elif roll < 0.21:
            m.forget_gemm(rng.choice("abcdef"))
        elif roll < 0.25 and late:
            m.complete(*late.pop(rng.randrange(len(late))))
        for worker_id in sorted(m.windows):
            if rng.random() < reliability[worker_id]:
                m.s.heartbeat(worker_id, m.now)
            for tile_id in sorted(m.s.in_flight(worker_id)):
                act = rng.random()
                if act < speed[worker_id]:
                    m.complete(worker_id, tile_id)
                elif act < speed[worker_id] + 0.01:
                    m.reject(worker_id, tile_id)
        alive = set(m.windows)
        m.expire()
        for worker_id in alive - set(m.windows):
            late.extend((worker_id, t) for t in m.submitted if rng.random() < 0.001)
        m.assign()
        if step % 25 == 0:
            m.check()
    m.check()
    stats = m.s.stats
    # The run exercised what it is meant to (same numbers for every run of a seed).
    assert stats.reissued > 0 and stats.rejected > 0
    assert stats.duplicates > 0 or slot_flops  # fuller windows: no late copy won in some runs
    assert len(m.removed) > 0 and len(m.forgotten) > 0
    m.drain()
    assert m.s.stats.completed == len(m.accepted)


def test_a_tile_refused_by_every_active_worker_is_stranded_until_taken_over() -> None:
    sched = Scheduler()
    sched.add_worker("only", window=2, now=0.0)
    sched.submit([TileTicket("t1", "g", 10, 10, 10), TileTicket("t2", "g", 10, 10, 10)])
    assert {a.tile_id for a in sched.assign(0.0)} == {"t1", "t2"}
    assert sched.stranded() == []
    sched.reject("only", "t1", 1.0, reason="refused: bad_signature")
    assert sched.assign(1.0) == []
    assert sched.stranded() == ["t1"]
    sched.add_worker("fresh", window=1, now=2.0)
    assert sched.stranded() == []  # someone new may take it: not stranded any more
    sched.remove_worker("fresh", 3.0)
    assert sched.take_over("t1") == []
    assert sched.is_done("t1") and sched.queued_count() == 0
    assert sched.complete("only", "t2", 4.0).verdict is Verdict.ACCEPTED
    assert sched.pending() == 0
    sched.check_invariants()


def test_a_tile_over_every_memory_cap_is_stranded_but_not_without_workers() -> None:
    sched = Scheduler()
    sched.submit([TileTicket("big", "g", 10, 1000, 1000)])
    assert sched.stranded() == []  # no worker yet: wait for one
    sched.add_worker("small", window=2, now=0.0, mem_cap_bytes=100)
    assert sched.assign(0.0) == []
    assert sched.stranded() == ["big"]


def _stranded_by_scan(sched: Scheduler) -> list[str]:
    """What `stranded` must answer, worked out the long way: every queued tile, against
    every active worker."""
    state = sched._state
    active = [w for w in state.workers.values() if not w.paused]
    if not active:
        return []
    stranded = []
    for entry in state.queue:
        tile = state.live_queue_entry(entry)
        if tile is None or tile.holders:
            continue
        able = [w for w in active if w.worker_id not in tile.refused_by and w.can_hold(tile.ticket)]
        if not able:
            stranded.append(tile.tile_id)
    return stranded


@pytest.mark.parametrize("seed", range(6))
def test_stranded_tiles_are_those_no_active_worker_may_take(seed: int) -> None:
    rng = random.Random(seed)
    sched = Scheduler(CONFIG)
    now, n = 0.0, 0
    for _ in range(300):
        now += 0.01
        roll = rng.random()
        workers = sched.workers()
        if roll < 0.15 or not workers:
            cap = rng.choice([None, 100, 200, 400])
            sched.add_worker(f"w{n}", window=rng.choice([1, 2]), now=now, mem_cap_bytes=cap)
            n += 1
        elif roll < 0.25:
            sched.remove_worker(rng.choice(workers), now)
        elif roll < 0.35:
            sched.set_paused(rng.choice(workers), rng.random() < 0.6, now)
        elif roll < 0.55:
            size = rng.choice([50, 150, 350, 500])
            sched.submit([ticket(f"t{n}", down=size - 10)])
            n += 1
        elif roll < 0.7:
            worker_id = rng.choice(workers)
            held = sorted(sched.in_flight(worker_id))
            if held:
                sched.reject(worker_id, rng.choice(held), now, reason="refused")
        elif roll < 0.8:
            worker_id = rng.choice(workers)
            for tile_id in sorted(sched.in_flight(worker_id))[:1]:
                sched.complete(worker_id, tile_id, now)
        else:
            sched.assign(now)
        assert sched.stranded() == _stranded_by_scan(sched)
        for tile_id in sched.stranded()[:1]:
            sched.take_over(tile_id)
    sched.check_invariants()


def test_the_largest_size_survives_the_heap_being_compacted() -> None:
    # Sizes gone at once leave stale entries under the largest, till the heap is rebuilt;
    # some of these counts have it rebuilt by the very add of 500.
    for churned in range(40, 180):
        sizes = Largest()
        sizes.add(10**6)
        for size in range(1, churned):
            sizes.add(size)
            sizes.remove(size)
        sizes.add(500)
        sizes.remove(10**6)
        assert sizes.largest() == 500, churned


@pytest.mark.parametrize("seed", range(4))
def test_the_largest_of_a_changing_multiset_of_sizes(seed: int) -> None:
    # Many sizes come and go while few are held at once (new ones often the largest),
    # so its heap is compacted along the way.
    rng = random.Random(seed)
    sizes, held = Largest(), Counter[int]()
    for step in range(3000):
        if len(held) > 3 or (held and rng.random() < 0.4):
            size = rng.choice(sorted(held.elements()))
            sizes.remove(size)
            held[size] -= 1
            held += Counter()  # drops sizes no longer held
        else:
            size = step + rng.randrange(-50, 50) if rng.random() < 0.8 else rng.randrange(1, 9)
            size = max(1, size)
            sizes.add(size)
            held[size] += 1
        assert sizes.largest() == max(held, default=None)
        assert sizes.counts() == held


def test_workers_leaving_do_not_each_send_the_stranded_check_through_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The core asks for stranded tiles after every leave. A network blip that drops half
    # of 10,000 workers, with tiles queued, read the whole queue each time: about a
    # minute of the event loop. A leave that cannot strand a tile must not read it.
    sched = Scheduler(CONFIG)
    for i in range(400):
        sched.add_worker(f"w{i}", window=1, now=0.0, mem_cap_bytes=1000)
    sched.submit(ticket(f"t{i}") for i in range(1200))
    sched.assign(0.0)
    reads = 0
    real = SchedulerState.live_queue_entry

    def counted(self: SchedulerState, entry: Any) -> Any:
        nonlocal reads
        reads += 1
        return real(self, entry)

    monkeypatch.setattr(SchedulerState, "live_queue_entry", counted)
    for i in range(200):
        sched.remove_worker(f"w{i}", 1.0)
        assert sched.stranded() == []
    assert reads < 1000  # the queue holds 1,000 tiles and more


def test_a_preferred_worker_takes_a_tile_ahead_of_its_turn() -> None:
    # w2 holds block "A1" (say, from an earlier tile of that row block of A).
    holds = {"w1": {"A0"}, "w2": {"A1"}}

    def prefers(worker_id: str, t: TileTicket) -> bool:
        return any(block in holds[worker_id] for block in t.blocks)

    def run(preference: object) -> list[tuple[str, str]]:
        sched = scheduler({"w1": 2, "w2": 2})
        sched.submit(
            [
                TileTicket("t-a1", "g", 10, 10, 10, blocks=("A1", "B0")),
                TileTicket("t-a0", "g", 10, 10, 10, blocks=("A0", "B1")),
                TileTicket("t-x", "g", 10, 10, 10, blocks=("A9", "B9")),
                TileTicket("t-a1b", "g", 10, 10, 10, blocks=("A1", "B1")),
            ]
        )
        return pairs(sched.assign(1.0, Table(holds=preference), timed=False))  # type: ignore[arg-type]

    assert run(None) == [("w1", "t-a1"), ("w2", "t-a0"), ("w1", "t-x"), ("w2", "t-a1b")]
    # t-a1 and t-a0 go to their holders out of turn; the rest keep the rotation.
    assert run(prefers) == [("w2", "t-a1"), ("w1", "t-a0"), ("w2", "t-x"), ("w1", "t-a1b")]


def test_a_lone_free_worker_takes_a_tile_of_the_same_gemm_it_holds_a_block_of() -> None:
    # w1 holds B1. Of g's queued tiles it takes t-b1 ahead of the head; t-b0 stays at
    # the head. It never takes a later GEMM's tile ahead of an earlier one's.
    holds = {"w1": {"B1", "B5"}}

    def prefers(worker_id: str, t: TileTicket) -> bool:
        return any(block in holds[worker_id] for block in t.blocks)

    sched = scheduler({"w1": 1})
    sched.submit(
        [
            TileTicket("t-b0", "g", 10, 10, 10, blocks=("A0", "B0")),
            TileTicket("t-b1", "g", 10, 10, 10, blocks=("A0", "B1")),
            TileTicket("t-h5", "h", 10, 10, 10, blocks=("A5", "B5")),
        ]
    )
    table = Table(holds=prefers)
    assert pairs(sched.assign(1.0, table, timed=False)) == [("w1", "t-b1")]  # type: ignore[arg-type]
    sched.complete("w1", "t-b1", 2.0)
    assert pairs(sched.assign(2.0, table, timed=False)) == [("w1", "t-b0")]  # type: ignore[arg-type]
    sched.complete("w1", "t-b0", 3.0)
    assert pairs(sched.assign(3.0, table, timed=False)) == [("w1", "t-h5")]  # type: ignore[arg-type]
    sched.check_invariants()
    # A worker that keeps no blocks takes the queue as it comes.
    sched.submit(tiles("t-x", "t-y"))
    sched.submit([TileTicket("t-b1b", "g", 10, 10, 10, blocks=("A0", "B1"))])
    sched.complete("w1", "t-h5", 4.0)
    no_cache = dataclasses.replace(table, keeps=False)
    assert pairs(sched.assign(4.0, no_cache, timed=False)) == [("w1", "t-x")]
    sched.complete("w1", "t-x", 5.0)
    assert pairs(sched.assign(5.0, table, timed=False)) == [("w1", "t-b1b")]  # type: ignore[arg-type]
