"""The coordinator's CPU breakdown: stage totals from any thread, threads by role."""

from __future__ import annotations

import threading
import time

from coordinator.step.cpu_costs import CpuCosts, since


def test_a_timed_stage_adds_the_cpu_time_it_took() -> None:
    now = [0.0]  # the calling thread's CPU clock, moved by hand
    costs = CpuCosts(lambda: now[0])
    for spent in (0.25, 0.5):
        with costs.timed("cut"):
            now[0] += spent
    costs.add("check", 0.125)
    assert costs.snapshot() == {"cut": 0.75, "check": 0.125}


def test_a_stage_that_raises_is_still_counted() -> None:
    now = [0.0]
    costs = CpuCosts(lambda: now[0])
    try:
        with costs.timed("decode"):
            now[0] += 0.5
            raise ValueError("bad frame")
    except ValueError:
        pass
    assert costs.snapshot() == {"decode": 0.5}


def test_adds_from_many_threads_all_land() -> None:
    costs = CpuCosts()

    def add() -> None:
        for _ in range(1000):
            costs.add("assemble", 1.0)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert costs.snapshot() == {"assemble": 4000.0}


def test_a_registered_thread_reports_its_own_cpu_time_until_it_ends() -> None:
    costs = CpuCosts()
    burned = threading.Event()
    leave = threading.Event()

    def busy() -> None:
        costs.this_thread_is("checks")
        start = time.thread_time()
        while time.thread_time() - start < 0.05:  # CPU, not sleep: sleeping costs none
            pass
        burned.set()
        leave.wait(10)

    thread = threading.Thread(target=busy)
    thread.start()
    assert burned.wait(10)
    registered = threading.Event()
    idle = threading.Thread(
        target=lambda: (costs.this_thread_is("ledger"), registered.set(), leave.wait(10))
    )
    idle.start()
    try:
        assert registered.wait(10)
        seen = costs.snapshot()
        assert seen["thread:checks"] >= 0.05
        assert seen["thread:ledger"] < 0.05  # waiting is not CPU time
    finally:
        leave.set()
        thread.join()
        idle.join()
    assert costs.snapshot() == {}  # ended threads drop out


def test_since_is_the_difference_by_name_rounded() -> None:
    assert since({"cut": 1.23456, "sign": 0.5}, {"cut": 1.0}) == {"cut": 0.2346, "sign": 0.5}


def test_a_thread_is_gone_as_soon_as_join_returns() -> None:
    # join() returns a moment before the OS thread exits: its CPU clock still reads.
    for _ in range(50):
        costs = CpuCosts()
        thread = threading.Thread(target=costs.this_thread_is, args=("checks",))
        thread.start()
        thread.join()
        assert costs.snapshot() == {}
