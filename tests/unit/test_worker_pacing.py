"""The pacer: rests and bandwidth waits, exact under an injected clock and wait.

``FakeTime`` (tests/support/fake_time.py) is also the time that
tests/loopback/test_worker_duty.py and tests/loopback/test_bandwidth.py give a whole
``WorkerCore``: its clocks move only when a wait passes (or a test says so), so every
rate comes out exact however loaded the machine is.
"""

from __future__ import annotations

import asyncio

import pytest
from support.fake_time import FakeTime, until

from client_app.pacing import Pacer

pytestmark = pytest.mark.timeout(30)


def started_pacer(
    time: FakeTime, cpu_percent: int = 100, kbps: int = 0, rests: list[bool] | None = None
) -> Pacer:
    pacer = Pacer(
        cpu_percent,
        kbps,
        clock=time.monotonic,
        wait=time.wait,
        on_rest=(lambda: rests.append(pacer.resting)) if rests is not None else lambda: None,
    )
    pacer.start()
    return pacer


# ---- rests ----------------------------------------------------------------------------


async def test_rest_after_each_tile_is_what_the_duty_cycle_asks() -> None:
    time, rests = FakeTime(), []
    pacer = started_pacer(time, cpu_percent=50, rests=rests)
    t0 = time.t
    for _ in range(4):
        start = time.t
        time.busy(1.0, 1.0)
        await pacer.rest_after_tile(start, time.t, 1.0)
    assert time.waits == pytest.approx([1.0] * 4)
    assert time.t - t0 == pytest.approx(8.0)  # busy half of the time, exactly
    assert rests == [True, False] * 4 and not pacer.resting  # observers saw each rest

    # A tile that cost less than its wall time (other programs slowed it) rests less.
    time.waits.clear()
    start = time.t
    time.busy(1.0, 0.0)
    await pacer.rest_after_tile(start, time.t, 0.6)
    assert time.waits == pytest.approx([0.2])


async def test_full_cpu_never_rests_and_a_new_limit_governs_the_next_rest() -> None:
    time, rests = FakeTime(), []
    pacer = started_pacer(time, cpu_percent=100, rests=rests)
    for _ in range(3):
        start = time.t
        time.busy(1.0, 1.0)
        await pacer.rest_after_tile(start, time.t, 1.0)
    assert time.waits == [] and rests == []
    pacer.request_cpu_percent(25)  # busy seconds at 100% are not owed at 25%
    start = time.t
    time.busy(1.0, 1.0)
    await pacer.rest_after_tile(start, time.t, 1.0)
    assert time.waits == pytest.approx([3.0]) and pacer.cpu_percent == 25


async def test_a_raised_limit_ends_a_rest_and_a_lowered_one_runs_its_course() -> None:
    time = FakeTime(hold_over_s=0.0)  # every rest is held until the limit changes
    pacer = started_pacer(time, cpu_percent=50)
    rest = asyncio.ensure_future(pacer.rest_after_tile(time.t - 1.0, time.t, 1.0))
    await until(lambda: len(time.held) == 1, "the rest to start")
    assert pacer.resting

    pacer.request_cpu_percent(25)
    pacer.cpu_percent_changed()
    # Woken, it goes on resting for what is left of the rest the old limit asked.
    await until(lambda: len(time.held) == 2, "the rest to go on")
    assert time.held == pytest.approx([1.0, 1.0]) and not rest.done()

    pacer.request_cpu_percent(100)
    pacer.cpu_percent_changed()
    await asyncio.wait_for(rest, 5)
    assert not pacer.resting and time.t == 1000.0  # ended at once: no clock moved


# ---- bandwidth ------------------------------------------------------------------------


async def test_frames_wait_exactly_what_the_rate_asks_each_way() -> None:
    time = FakeTime()
    pacer = started_pacer(time, kbps=1)  # 1024 B/s each way, a 16 KiB burst
    await pacer.after_receiving(16 * 1024)  # the burst passes at once
    await pacer.after_receiving(2048)
    await pacer.after_receiving(1024)
    assert time.waits == pytest.approx([2.0, 1.0])
    # The upload has its own bucket: its burst is still whole (the 3 s passed refilled
    # only 3 KiB of it, which it already had).
    await pacer.before_sending(16 * 1024)
    await pacer.before_sending(512)
    assert time.waits == pytest.approx([2.0, 1.0, 0.5])
    assert time.t == pytest.approx(1003.5)


async def test_unlimited_bandwidth_never_waits() -> None:
    time = FakeTime()
    pacer = started_pacer(time, kbps=0)
    for _ in range(3):
        await pacer.after_receiving(1 << 30)
        await pacer.before_sending(1 << 30)
    assert time.waits == []


async def test_a_rate_change_recomputes_a_wait_under_way() -> None:
    time = FakeTime(hold_over_s=5.0)
    pacer = started_pacer(time, kbps=1)
    receiving = asyncio.ensure_future(pacer.after_receiving(16 * 1024 + 10 * 1024))
    await until(lambda: time.held == [pytest.approx(10.0)], "a 10 s wait")
    time.t += 2.0  # 2 KiB of the 10 KiB owed paid off meanwhile
    pacer.request_bandwidth_kbps(4)
    pacer.bandwidth_changed()
    await asyncio.wait_for(receiving, 5)
    assert time.waits == pytest.approx([10.0, 2.0])  # the other 8 KiB at 4 KiB/s

    receiving = asyncio.ensure_future(pacer.after_receiving(64 * 1024))
    await until(lambda: len(time.held) == 2, "a long wait")
    pacer.request_bandwidth_kbps(0)  # lifted: the wait ends at once
    pacer.bandwidth_changed()
    await asyncio.wait_for(receiving, 5)
    assert pacer.bandwidth_kbps == 0 and len(time.waits) == 3


def test_bad_limits_are_refused_where_they_are_set() -> None:
    pacer = Pacer(100, 0, clock=FakeTime().monotonic)
    for percent in (0, 101):
        with pytest.raises(ValueError):
            pacer.request_cpu_percent(percent)
    with pytest.raises(ValueError):
        pacer.request_bandwidth_kbps(-1)
    assert (pacer.cpu_percent, pacer.bandwidth_kbps) == (100, 0)
    with pytest.raises(ValueError):
        Pacer(0, 0, clock=FakeTime().monotonic)
