"""A coordinator that keeps every GEMM at home says so to its workers, and an operator
who wants the volunteers to compute gets them computing: real processes on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.procs import Coordinator, Worker, wait_until

from coordinator.step.progress import ALONE_NOTE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _tiles_of(coord: Coordinator, name: str) -> int:
    return sum(w["tiles_session"] for w in coord.status()["workers"] if w["name"] == name)


def _run(tmp_path: Path, gflops: str) -> tuple[Coordinator, Worker]:
    coord = Coordinator(
        tmp_path,
        *("--planner", "cost", "--coordinator-gflops", gflops),
        *("--steps", "100000", "--checkpoint-every", "100000"),  # stopped by the test
    )
    return coord, Worker(tmp_path, coord.url, "volunteer")


def test_a_coordinator_faster_alone_tells_its_idle_worker_why(tmp_path: Path) -> None:
    # A coordinator that believes itself far faster than any tile's round trip.
    coord, worker = _run(tmp_path, "100000")
    try:
        wait_until(lambda: len(coord.steps()) >= 2, 150, "two steps")
        assert coord.status()["note"] == ALONE_NOTE
        wait_until(lambda: ALONE_NOTE in worker.output(), 30, "the worker to be told")
        assert _tiles_of(coord, "volunteer") == 0
        assert "the coordinator says: " + ALONE_NOTE in worker.output()
    finally:
        worker.stop()
        coord.stop()


def test_coordinator_gflops_zero_hands_the_tiles_to_volunteers(tmp_path: Path) -> None:
    coord, worker = _run(tmp_path, "0")
    try:
        wait_until(lambda: len(coord.steps()) >= 2, 150, "two steps")
        wait_until(lambda: _tiles_of(coord, "volunteer") > 0, 30, "tiles for the volunteer")
        assert coord.status()["note"] != ALONE_NOTE
        assert ALONE_NOTE not in worker.output()
    finally:
        worker.stop()
        coord.stop()
