"""The CPU-time limit: the duty-cycle controller (pure), then a real worker on loopback.

Both run on an injected clock: the controller takes every time as an argument, and the
worker gets a ``FakeTime`` whose clocks move only by what its tile computer says a tile
took and by the rests it asks for. So the share of the cores it uses comes out exact,
however loaded the machine is. How close a worker comes to its limit in real time is a
measurement, not a test: ``python bench/bench_limits.py`` prints it.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from support.fake_coordinator import PROFILE, FakeCoordinator, Link, stop
from support.fake_time import FakeTime, until

from client_app.compute import TileComputer
from client_app.config import PinStore, WorkerSettings
from client_app.duty import DutyCycle, fraction_from_percent
from client_app.options import WorkerOptions
from client_app.status import WorkerStatus
from client_app.worker import RunResult, WorkerCore
from common.messages import Result

pytestmark = pytest.mark.timeout(60)

# ---- the controller, with a fake clock -----------------------------------------------


def run_units(duty: DutyCycle, costs: list[float], oversleep: float = 0.0) -> list[float]:
    """Back-to-back units, each costing its wall time, resting as told (+ oversleep)."""
    now, rests = 0.0, []
    for cost in costs:
        start, now = now, now + cost
        rest = duty.unit_done(start, now, cost)
        rests.append(rest)
        now += rest + (oversleep if rest > 0 else 0.0)
    return rests


def test_rest_is_proportional_to_each_unit() -> None:
    assert run_units(DutyCycle(0.5), [1.0, 1.0, 0.2, 3.0]) == pytest.approx([1.0, 1.0, 0.2, 3.0])
    assert run_units(DutyCycle(0.25), [1.0, 2.0]) == pytest.approx([3.0, 6.0])
    # A long tile cannot be split: it is paid for by a proportionally long rest after it.
    assert run_units(DutyCycle(0.5, window_s=5.0), [0.1, 20.0]) == pytest.approx([0.1, 20.0])


def test_full_fraction_never_rests() -> None:
    assert run_units(DutyCycle(1.0), [0.5, 30.0, 0.01]) == [0.0, 0.0, 0.0]


def test_oversleeping_and_waiting_count_as_rest_taken() -> None:
    duty = DutyCycle(0.5)
    assert duty.unit_done(0.0, 1.0, 1.0) == pytest.approx(1.0)
    # Slept 0.3 s too long: the next rest is that much shorter.
    assert duty.unit_done(2.3, 3.3, 1.0) == pytest.approx(0.7)
    # Waited 5 s for a tile: enough credit for the next one to run without a rest.
    assert duty.unit_done(9.0, 10.0, 1.0) == 0.0


def test_converges_to_the_target_despite_a_sloppy_sleeper() -> None:
    duty = DutyCycle(0.3, window_s=20.0)
    rng = random.Random(1)
    now = busy = 0.0
    for _ in range(400):
        cost = rng.uniform(0.01, 0.2)
        start, now = now, now + cost
        busy += cost
        now += duty.unit_done(start, now, cost) * rng.uniform(1.0, 1.3) + 0.002
    assert busy / now == pytest.approx(0.3, rel=0.05)


def test_cost_below_wall_time_rests_less() -> None:
    # Other programs slowed the GEMM: 1 s of wall time used 0.6 s of the granted cores.
    duty = DutyCycle(0.5)
    assert duty.unit_done(0.0, 1.0, 0.6) == pytest.approx(0.2)
    assert DutyCycle(0.5).unit_done(0.0, 1.0, 0.4) == 0.0


def test_a_changed_fraction_applies_to_the_next_unit_without_history() -> None:
    duty = DutyCycle(1.0)
    assert run_units(duty, [1.0] * 5) == [0.0] * 5
    duty.set_fraction(0.5)  # five busy seconds at 100% are not owed now
    assert duty.unit_done(5.0, 6.0, 1.0) == pytest.approx(1.0)
    duty.set_fraction(0.2)
    assert duty.unit_done(7.0, 8.0, 1.0) == pytest.approx(4.0)
    duty.set_fraction(1.0)
    assert duty.unit_done(12.0, 13.0, 1.0) == 0.0


def test_old_units_leave_the_window() -> None:
    duty = DutyCycle(0.5, window_s=10.0)
    assert duty.unit_done(0.0, 1.0, 1.0) == pytest.approx(1.0)
    # The first unit ended more than a window before this one: only this one counts.
    assert duty.unit_done(30.0, 31.0, 1.0) == pytest.approx(1.0)


def test_bad_values_are_refused() -> None:
    for fraction in (0.0, -0.5, 1.01):
        with pytest.raises(ValueError):
            DutyCycle(fraction)
    with pytest.raises(ValueError):
        DutyCycle(0.5).unit_done(2.0, 1.0, 0.5)
    assert fraction_from_percent(50) == 0.5 and fraction_from_percent(100) == 1.0
    for percent in (0, 101, True, 50.0):
        with pytest.raises(ValueError):
            fraction_from_percent(percent)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        make_core("ws://127.0.0.1:1/ws", Path("."), cpu_percent=0)


# ---- a real worker, on a fake clock --------------------------------------------------


class TimedComputer(TileComputer):
    """Computes the real (tiny) tile, and tells the fake time that it took ``wall_s``
    seconds and ``cpu_s`` CPU seconds of the process."""

    def __init__(self, time: FakeTime, threads: int, *, wall_s: float, cpu_s: float) -> None:
        super().__init__(threads, use_gpu=False)
        self.time, self.wall_s, self.cpu_s = time, wall_s, cpu_s

    def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        c = super().compute(op, a, b)
        self.time.busy(self.wall_s, self.cpu_s)
        return c


def make_core(
    url: str,
    config: Path,
    time: FakeTime | None = None,
    computer: TileComputer | None = None,
    statuses: list[WorkerStatus] | None = None,
    **settings: Any,
) -> WorkerCore:
    time = time or FakeTime()
    options = WorkerOptions(
        computer=computer or TimedComputer(time, 1, wall_s=0.03, cpu_s=0.03),
        profile=PROFILE,
        backoff_base_s=0.02,
        backoff_cap_s=0.1,
        rng=random.Random(0),
        clocks=time.clocks(),
    )
    return WorkerCore(
        WorkerSettings(
            coordinator_url=url, name="duty-w", threads=1, use_gpu=False, window=2, **settings
        ),
        pin_check=PinStore.in_dir(config).check,
        options=options,
        observer=statuses.append if statuses is not None else None,
    )


async def supply(coord: FakeCoordinator, link: Link, n: int, first: int = 0) -> None:
    """``n`` tiles, holding the worker's window (2) full; returns once all are answered."""
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    frames = [coord.task(f"t-{first + i}", a, b) for i in range(n)]
    for frame in frames[:2]:
        await link.send(frame)
    for i in range(n):
        await link.expect(Result)
        if i + 2 < n:
            await link.send(frames[i + 2])


async def test_half_cpu_uses_exactly_half_of_the_granted_cores(tmp_path: Path) -> None:
    time, statuses = FakeTime(), []
    # Each tile keeps both granted cores busy for 0.03 s (0.06 CPU seconds), stretched to
    # 0.04 s of wall time by other programs: it is charged 0.03 s and rests 0.02 s.
    computer = TimedComputer(time, 2, wall_s=0.04, cpu_s=0.06)
    async with FakeCoordinator() as coord:
        core = make_core(coord.url, tmp_path, time, computer, statuses, cpu_percent=50)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        await supply(coord, link, 20)
        await until(lambda: len(time.waits) == 20, "the rest after the last tile")
        assert await stop(core, run) is RunResult.STOPPED
    assert time.waits == pytest.approx([0.02] * 20)
    assert (time.cpu / 2) / (time.t - 1000.0) == pytest.approx(0.5, rel=1e-9)
    assert "Resting (CPU limit 50%)" in {s.line for s in statuses}


async def test_full_cpu_never_rests_and_a_live_change_applies(tmp_path: Path) -> None:
    time, statuses = FakeTime(), []
    async with FakeCoordinator() as coord:
        core = make_core(coord.url, tmp_path, time, statuses=statuses)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        await supply(coord, link, 10)
        assert time.waits == [] and not any("Resting" in s.line for s in statuses)

        # From another thread, as a GUI would: the next tiles' rests obey 25%, and the
        # busy time at 100% is not owed (0.03 s tiles, 0.09 s rests).
        await asyncio.to_thread(core.set_cpu_percent, 25)
        await supply(coord, link, 5, first=10)
        await until(lambda: len(time.waits) == 5, "the rest after the last tile")
        assert time.waits == pytest.approx([0.09] * 5)
        assert core.cpu_percent == 25
        with pytest.raises(ValueError):
            core.set_cpu_percent(0)
        assert await stop(core, run) is RunResult.STOPPED


async def test_a_resting_worker_keeps_talking_and_a_raised_limit_ends_its_rest(
    tmp_path: Path,
) -> None:
    time = FakeTime(hold_over_s=0.0)  # every rest lasts until the limit changes
    async with FakeCoordinator() as coord:
        core = make_core(coord.url, tmp_path, time, cpu_percent=25)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        a, b = torch.randn(8, 8), torch.randn(8, 8)
        await link.send(coord.task("t-0", a, b))
        await link.expect(Result)
        await until(lambda: len(time.held) == 1, "the rest after t-0")
        assert time.held == pytest.approx([0.09])
        assert core.status.line == "Resting (CPU limit 25%)"

        # While it rests, the worker takes in the next tile but does not start it...
        taken_in = core.status.bytes_in
        await link.send(coord.task("t-1", a, b))
        await until(lambda: core.status.bytes_in > taken_in, "t-1 to be taken in")
        assert core.status.current_tile == "" and core.status.state == "computing"
        # ... and heartbeats go on (they are due once the clock has moved on).
        beats = len(link.heartbeats)
        time.t += 1.0
        await until(lambda: len(link.heartbeats) > beats, "a heartbeat during the rest")

        core.set_cpu_percent(100)  # owes no more of the rest: t-1 goes at once
        await link.expect(Result)
        assert time.held == pytest.approx([0.09]) and core.status.tiles_done == 2
        assert await stop(core, run) is RunResult.STOPPED
    assert time.t == pytest.approx(1000.0 + 2 * 0.03 + 1.0)  # the tiles and the nudge only
