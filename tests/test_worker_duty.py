"""The CPU-time limit: the duty-cycle controller (pure) and a measured worker.

The controller is tested exactly, with a fake clock. The measured tests run a real
``WorkerCore`` against the loopback fake coordinator and assert only what load on the
machine cannot break: the worker never uses more CPU time than its limit allows (+15%),
rests at a limit below 100% and never at 100%. How close it comes to the limit from
below is a measurement, not a test: ``python bench/bench_limits.py`` prints it.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_worker_loopback import PROFILE, FakeCoordinator, Link, within

from client_app.compute import TileComputer
from client_app.config import PinStore, WorkerSettings
from client_app.duty import DutyCycle, fraction_from_percent
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


# ---- a real worker, measured ---------------------------------------------------------

TILE_CPU_S = 0.03  # each tile burns this much CPU time on the compute thread


class BurningComputer(TileComputer):
    """Computes the real tile, then burns a fixed CPU time in fp32 matmuls.

    Burning CPU time (not wall time) keeps every tile's work the same when other tests
    compete for the cores; tiny operands keep the wire and signature work negligible.
    """

    def __init__(self) -> None:
        super().__init__(1, use_gpu=False)
        self.burned_cpu_s = 0.0  # the compute thread's own CPU time in tiles
        self.busy_wall_s = 0.0
        self._x = torch.randn(128, 128)

    def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        c = super().compute(op, a, b)
        while time.thread_time() - cpu0 < TILE_CPU_S:
            torch.matmul(self._x, self._x)
        self.burned_cpu_s += time.thread_time() - cpu0
        self.busy_wall_s += time.perf_counter() - wall0
        return c


def make_core(
    url: str, config: Path, statuses: list[WorkerStatus] | None = None, **settings: Any
) -> WorkerCore:
    return WorkerCore(
        WorkerSettings(
            coordinator_url=url, name="duty-w", threads=1, use_gpu=False, window=2, **settings
        ),
        pin_check=PinStore.in_dir(config).check,
        observer=statuses.append if statuses is not None else None,
        computer=BurningComputer(),
        profile=PROFILE,
        backoff_base_s=0.02,
        backoff_cap_s=0.1,
        rng=random.Random(0),
    )


async def keep_supplied(coord: FakeCoordinator, link: Link, window: int = 2) -> None:
    """Hold the worker's window full: a new tile for every result, forever."""
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    # Signed ahead of time so that the fake coordinator's own CPU barely shows.
    frames = iter([coord.task(f"t-{i}", a, b) for i in range(2000)])
    for _ in range(window):
        await link.send(next(frames))
    while True:
        await link.expect(Result)
        await link.send(next(frames))


class Meter:
    """CPU time between two marks: the worker's two threads, and the whole process.

    Mark and read on the event loop thread. The worker's CPU time is its compute thread
    plus its event loop thread (which also runs the tiny fake coordinator). The whole
    process also holds whatever threads earlier tests in this pytest run left behind,
    so it is only reported, not asserted on.
    """

    def __init__(self, computer: BurningComputer) -> None:
        self.computer = computer
        self.mark()

    def mark(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        self.loop_cpu0 = time.thread_time()
        self.burned0, self.busy0 = self.computer.burned_cpu_s, self.computer.busy_wall_s

    def read(self) -> dict[str, float]:
        wall = time.perf_counter() - self.wall0
        compute = (self.computer.burned_cpu_s - self.burned0) / wall
        loop = (time.thread_time() - self.loop_cpu0) / wall
        return {
            "window_s": wall,
            "worker": compute + loop,
            "compute_thread": compute,
            "loop_thread": loop,
            "process": (time.process_time() - self.cpu0) / wall,
            "busy_wall": (self.computer.busy_wall_s - self.busy0) / wall,
        }


def measure_cpu(percent: int, config: Path, seconds: float = 4.0) -> dict[str, float]:
    """A worker kept supplied with tiles at ``percent``: its CPU-time figures over
    ``seconds`` after a warm-up, the heartbeats meanwhile, and whether it rested."""
    statuses: list[WorkerStatus] = []

    async def scenario() -> dict[str, float]:
        async with FakeCoordinator(heartbeat_interval_s=0.1) as coord:
            core = make_core(coord.url, config, statuses, cpu_percent=percent)
            assert isinstance(core.computer, BurningComputer)
            run = asyncio.create_task(core.run())
            link = await coord.next_link()
            feeder = asyncio.create_task(keep_supplied(coord, link))
            await asyncio.sleep(1.0)  # warm-up: torch's first matmuls, the first rests
            meter, beats0 = Meter(core.computer), len(link.heartbeats)
            await asyncio.sleep(seconds)
            figures = meter.read()
            # Heartbeats kept coming while the worker rested (every 0.1 s, give or take).
            figures["heartbeats"] = len(link.heartbeats) - beats0
            feeder.cancel()
            core.stop()
            assert await within(run) is RunResult.STOPPED
        return figures

    figures = asyncio.run(scenario())
    figures["rested"] = float(f"Resting (CPU limit {percent}%)" in {s.line for s in statuses})
    return figures


def test_half_cpu_never_exceeds_its_limit(tmp_path: Path) -> None:
    figures = measure_cpu(50, tmp_path)
    print(f"\nCPU limit 50%: {figures}")
    # Over the limit is a bug; under it, only a loaded machine (bench/bench_limits.py).
    assert figures["worker"] <= 0.575, figures
    assert figures["compute_thread"] > 0 and figures["rested"], figures
    assert figures["heartbeats"] >= 5, figures  # it kept talking while it rested


def test_full_cpu_never_rests_and_a_live_change_applies(tmp_path: Path) -> None:
    statuses: list[WorkerStatus] = []

    async def scenario() -> tuple[dict[str, float], dict[str, float], int]:
        async with FakeCoordinator(heartbeat_interval_s=0.1) as coord:
            core = make_core(coord.url, tmp_path, statuses)
            assert isinstance(core.computer, BurningComputer)
            run = asyncio.create_task(core.run())
            link = await coord.next_link()
            feeder = asyncio.create_task(keep_supplied(coord, link))
            await asyncio.sleep(0.3)
            meter = Meter(core.computer)
            await asyncio.sleep(1.0)
            full = meter.read()
            rested_at_full = sum("Resting" in s.line for s in statuses)

            # From another thread, as a GUI would: the next tile's rest obeys 25%.
            threading.Thread(target=core.set_cpu_percent, args=(25,)).start()
            await asyncio.sleep(0.3)
            meter.mark()
            await asyncio.sleep(1.5)
            quarter = meter.read()

            # Raising the limit ends a rest under way (within seconds even under load;
            # the rest the 25% limit asks after a tile is longer).
            core.set_cpu_percent(100)
            for _ in range(100):
                if not core.status.line.startswith("Resting"):
                    break
                await asyncio.sleep(0.05)
            assert not core.status.line.startswith("Resting"), core.status
            feeder.cancel()
            core.stop()
            assert await within(run) is RunResult.STOPPED
        return full, quarter, rested_at_full

    full, quarter, rested_at_full = asyncio.run(scenario())
    print(f"\nCPU limit 100%: {full}\nCPU limit 25%: {quarter}")
    assert rested_at_full == 0 and full["compute_thread"] > 0, full
    assert quarter["worker"] <= 0.25 * 1.3, quarter
    assert "Resting (CPU limit 25%)" in {s.line for s in statuses}
    with pytest.raises(ValueError):
        make_core("ws://x/ws", tmp_path).set_cpu_percent(0)
