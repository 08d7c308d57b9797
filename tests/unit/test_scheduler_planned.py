"""Planned tiles (`TileTicket.planned_for`): each waits for the worker the planner placed
it on, unless another would return it clearly sooner (a steal). Exact tables with an
explicit clock and hand-made predictions."""

from __future__ import annotations

from dataclasses import replace

from support.scheduler_tables import Table, ticket

from coordinator.schedule.scheduler import STEAL_MARGIN, Assignment, Scheduler, SchedulerConfig

CONFIG = SchedulerConfig(heartbeat_timeout_s=10.0, tile_timeout_s=300.0)
# fast needs 1 s per tile, slow 10 s, mid 2 s (a tile's run time equals what it adds
# behind other tiles here: the table's busy_time defaults to its run times).
RUN = {"fast": 1.0, "slow": 10.0, "mid": 2.0}


def planned(tile_id: str, worker_id: str | None):  # type: ignore[no-untyped-def]
    return replace(ticket(tile_id), planned_for=worker_id)


def pairs(assignments: list[Assignment]) -> list[tuple[str, str]]:
    return [(a.worker_id, a.tile_id) for a in assignments]


def pool(*workers: tuple[str, int]) -> Scheduler:
    sched = Scheduler(CONFIG)
    for worker_id, window in workers:
        sched.add_worker(worker_id, window=window, now=0.0)
    return sched


def test_planned_tiles_go_to_their_worker_first_and_in_plan_order() -> None:
    sched = pool(("a", 2), ("b", 2))
    sched.submit([planned("t1", "b"), ticket("t2"), planned("t3", "b"), planned("t4", "a")])
    # Planned tiles first (b: t1, t3, in plan order; a: t4; the workers in the order
    # their plans began), then the common queue (t2) to the next worker with a free slot.
    assert pairs(sched.assign(0.0)) == [("b", "t1"), ("b", "t3"), ("a", "t4"), ("a", "t2")]
    sched.check_invariants()


def test_a_planned_tile_waits_for_its_busy_worker_when_nobody_is_much_sooner() -> None:
    sched = pool(("fast", 1), ("slow", 1))
    sched.submit([ticket("t0")])
    assert pairs(sched.assign(0.0)) == [("fast", "t0")]
    sched.submit([planned("t1", "fast")])
    # fast returns t0 at 1, then t1 at 2; slow would return t1 at 10 > 2 / margin.
    finish = {("fast", "t0"): 1.0}
    assert sched.assign(0.0, Table(finish, RUN)) == []
    assert sched.queued_count() == 1
    sched.complete("fast", "t0", 1.0)
    assert pairs(sched.assign(1.0, Table({}, RUN))) == [("fast", "t1")]
    sched.check_invariants()


def test_a_free_worker_steals_the_last_planned_tile_it_would_return_clearly_sooner() -> None:
    sched = pool(("fast", 1), ("mid", 1))
    sched.submit([ticket("t0")])
    assert pairs(sched.assign(0.0)) == [("fast", "t0")]
    sched.submit([planned(f"t{i}", "fast") for i in (1, 2, 3, 4)])
    # fast is free at 1 and then needs 1 s per tile: t4, its last, is back at 5. mid
    # would return it at 2, and 2 x 1.5 = 3 < 5: mid takes t4 (the back of the queue,
    # so fast keeps the tiles it would return first). mid is then full.
    assert STEAL_MARGIN == 1.5
    finish = {("fast", "t0"): 1.0}
    assert pairs(sched.assign(0.0, Table(finish, RUN))) == [("mid", "t4")]
    sched.complete("mid", "t4", 2.0)
    # At 2: fast holds t0 (overdue: back at 2.5, say), then t1..t3: back at 5.5; mid
    # would return t3 at 2 from now: 3 < 3.5, it steals t3.
    finish = {("fast", "t0"): 2.5}
    assert pairs(sched.assign(2.0, Table(finish, RUN))) == [("mid", "t3")]
    sched.complete("mid", "t3", 4.0)
    # At 4 (fast still on t0 until 4.5): t1, t2 back at 6.5, 2.5 from now; mid's 2 x 1.5
    # = 3 is not clearly sooner: the rest stays with fast.
    finish = {("fast", "t0"): 4.5}
    assert sched.assign(4.0, Table(finish, RUN)) == []
    sched.complete("fast", "t0", 4.5)
    finish = {("fast", "t1"): 5.5}
    assert pairs(sched.assign(4.5, Table(finish, RUN))) == [("fast", "t1")]
    sched.check_invariants()


def test_the_thief_is_counted_busy_with_what_it_holds() -> None:
    sched = pool(("fast", 1), ("mid", 2))
    sched.submit([ticket("t0"), ticket("m0")])
    assert pairs(sched.assign(0.0)) == [("fast", "t0"), ("mid", "m0")]
    sched.submit([planned(f"t{i}", "fast") for i in (1, 2, 3, 4)])
    # mid holds m0 until 3: t4 from mid would be back at 5 (3 + 2); from fast at 5:
    # no steal, although mid has a free slot.
    finish = {("fast", "t0"): 1.0, ("mid", "m0"): 3.0}
    assert sched.assign(0.0, Table(finish, RUN)) == []
    assert sched.queued_count() == 4


def test_without_predictions_free_workers_steal_from_the_longest_planned_queue() -> None:
    sched = pool(("a", 1), ("b", 1), ("c", 1))
    sched.submit([planned("a1", "a"), planned("a2", "a"), planned("b1", "b")])
    sched.submit([planned("a3", "a"), planned("b2", "b")])
    # a and b take their first planned tile; c, free, takes the back of a's queue (two
    # left, b has one).
    assert pairs(sched.assign(0.0)) == [("a", "a1"), ("b", "b1"), ("c", "a3")]
    sched.check_invariants()


def test_a_planned_worker_that_leaves_or_pauses_frees_its_tiles_for_anyone() -> None:
    sched = pool(("a", 1), ("b", 1))
    sched.submit([ticket("x")])
    assert pairs(sched.assign(0.0)) == [("a", "x")]
    sched.submit([planned("p1", "b"), planned("p2", "b"), planned("p3", "b")])
    assert pairs(sched.assign(0.0)) == [("b", "p1")]
    sched.set_paused("b", True, 1.0)  # p1 goes back to the front; p2, p3 follow it
    sched.complete("a", "x", 1.0)
    assert pairs(sched.assign(1.0)) == [("a", "p1")]
    sched.check_invariants()
    sched.set_paused("b", False, 2.0)
    assert pairs(sched.assign(2.0)) == [("b", "p2")]
    sched.remove_worker("b", 3.0)  # p2 back to the front of the common queue, then p3
    sched.complete("a", "p1", 3.0)
    assert pairs(sched.assign(3.0)) == [("a", "p2")]
    sched.check_invariants()
    assert sched.queued_count() == 1


def test_unknown_owners_and_reissued_tiles_use_the_common_queue() -> None:
    sched = pool(("a", 2), ("b", 1))
    sched.submit([planned("t1", "gone"), planned("t2", "b")])
    assert pairs(sched.assign(0.0)) == [("b", "t2"), ("a", "t1")]
    # b drops t2: re-issued, it no longer waits for b (it goes to whoever is free).
    lost = sched.remove_worker("b", 1.0)
    assert lost == ["t2"]
    sched.add_worker("b", window=1, now=1.0)
    got = sched.assign(1.0)
    assert pairs(got) == [("a", "t2")] and got[0].reissue
    sched.check_invariants()
