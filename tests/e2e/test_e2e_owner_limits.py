"""The owner's limits against a real coordinator on 127.0.0.1: a hot CPU pauses the
worker within one policy tick and its tiles go to another worker; it resumes only once
it has cooled by the hysteresis. Computing only while idle switches with its grace
period. Readings are injected; the worker, the policy runner and the coordinator are
the product's own."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.procs import Coordinator, Worker, wait_until

from client_app.config import WorkerSettings
from client_app.options import WorkerOptions
from client_app.policy import Readings
from client_app.policy_runner import PolicyRunner
from client_app.worker import WorkerCore

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TICK_S = 0.1


class Machine:
    """Readings the test sets, as a sampler the runner calls on every tick."""

    def __init__(self, **readings: Any) -> None:
        self.readings = Readings(on_battery=False, **readings)
        self.samples = 0  # ticks that have read the machine

    def set(self, **readings: Any) -> None:
        self.readings = Readings(on_battery=False, **readings)

    def __call__(self) -> Readings:
        self.samples += 1
        return self.readings

    def ticks(self, count: int) -> None:
        """Return once the runner has read the current readings ``count`` more times."""
        until = self.samples + count
        wait_until(lambda: self.samples >= until, 30, f"{count} policy ticks")


def _worker(coord: Coordinator, name: str) -> dict[str, Any]:
    rows = [w for w in coord.status()["workers"] if w["name"] == name]
    return rows[0] if rows else {}


def _tiles(coord: Coordinator, name: str) -> int:
    return int(_worker(coord, name).get("tiles_session", 0))


@pytest.fixture
def run_worker(tmp_path: Path) -> Iterator[Callable[[str, WorkerSettings, Machine], WorkerCore]]:
    """Start a WorkerCore and its PolicyRunner on a thread of their own (as the app does)."""
    running: list[tuple[WorkerCore, PolicyRunner, threading.Thread]] = []

    def start(url: str, settings: WorkerSettings, machine: Machine) -> WorkerCore:
        settings = WorkerSettings(**{**settings.to_json(), "coordinator_url": url})
        core = WorkerCore(
            settings, pin_check=lambda u, k: True, options=WorkerOptions(backoff_base_s=0.05)
        )
        runner = PolicyRunner(core, settings, sample=machine, interval_s=TICK_S)

        async def both() -> None:
            task = asyncio.ensure_future(runner.run())
            try:
                await core.run()
            finally:
                runner.stop()
                await task

        thread = threading.Thread(target=asyncio.run, args=(both(),), daemon=True)
        thread.start()
        running.append((core, runner, thread))
        return core

    yield start
    for core, _runner, thread in running:
        core.stop()
        thread.join(15)


def test_a_hot_cpu_pauses_at_once_and_resumes_below_the_hysteresis(
    tmp_path: Path, run_worker: Callable[[str, WorkerSettings, Machine], WorkerCore]
) -> None:
    coord = Coordinator(tmp_path, "--steps", "400", "--checkpoint-every", "1000")
    other = Worker(tmp_path, coord.url, "cool-w")
    machine = Machine(cpu_temp_c=60.0)
    settings = WorkerSettings(
        name="hot-w", threads=1, use_gpu=False, max_cpu_temp_c=80.0, temp_hysteresis_c=5.0
    )
    core = run_worker(coord.url, settings, machine)
    try:
        wait_until(lambda: _tiles(coord, "hot-w") > 0, 120, "hot-w to compute tiles")

        machine.set(cpu_temp_c=90.0)  # the pause goes out at the next tick
        wait_until(lambda: _worker(coord, "hot-w").get("state") == "paused", 30, "the pause")
        row = _worker(coord, "hot-w")
        assert row["reason"] == "CPU at 90 °C, limit 80 °C" and row["in_flight"] == 0
        assert core.status.line == "Paused: CPU at 90 °C, limit 80 °C"

        # Its work goes on elsewhere while it is paused.
        others = _tiles(coord, "cool-w")
        wait_until(lambda: _tiles(coord, "cool-w") > others + 3, 60, "cool-w to take the tiles")
        # Read only now: a result finished before the pause may follow the Pause frame.
        held = _tiles(coord, "hot-w")
        # Cooler than the limit, not yet by the hysteresis: still paused.
        machine.set(cpu_temp_c=77.0)
        machine.ticks(5)
        assert _worker(coord, "hot-w")["state"] == "paused" and _tiles(coord, "hot-w") == held

        machine.set(cpu_temp_c=74.0)
        wait_until(lambda: _tiles(coord, "hot-w") > held, 60, "hot-w to compute again")
        assert _worker(coord, "hot-w")["reason"] == ""
    finally:
        other.stop()
        coord.kill()


def test_computing_only_while_idle_switches_with_its_grace_period(
    tmp_path: Path, run_worker: Callable[[str, WorkerSettings, Machine], WorkerCore]
) -> None:
    coord = Coordinator(tmp_path, "--steps", "400", "--checkpoint-every", "1000")
    other = Worker(tmp_path, coord.url, "steady-w")
    machine = Machine(other_cpu_percent=60.0)  # the owner is busy
    grace_s = 3.0
    settings = WorkerSettings(
        name="idle-w",
        threads=1,
        use_gpu=False,
        in_use_cpu_percent=0,  # pause while in use
        idle_minutes=grace_s / 60,
    )
    core = run_worker(coord.url, settings, machine)
    try:
        wait_until(lambda: _worker(coord, "idle-w").get("state") == "paused", 60, "a pause")
        assert _worker(coord, "idle-w")["reason"] == "computer in use"
        assert core.status.limits_mode == "in use" and _tiles(coord, "idle-w") == 0

        quiet_at = time.monotonic()  # before the set: the runner may read it at once
        machine.set(other_cpu_percent=2.0)  # quiet from now on
        wait_until(lambda: _tiles(coord, "idle-w") > 0, 60, "idle-w to compute once idle")
        # Not before the grace period: a quiet moment is not yet an idle computer.
        assert time.monotonic() - quiet_at >= grace_s
        assert core.status.limits_mode == "idle"

        machine.set(other_cpu_percent=70.0, user_idle_s=0.0)  # the owner is back
        wait_until(lambda: _worker(coord, "idle-w").get("state") == "paused", 30, "the pause")
    finally:
        other.stop()
        coord.kill()
