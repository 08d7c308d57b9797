"""End to end with the cost-model planner (the default of `cleave-coordinator serve`).

Real processes on loopback. The planner decides from measured speeds and links, so
these tests assert what must hold whatever it decides: losses equal plain local torch
(1e-5 relative), every tile is accounted for, and where the coordinator takes a share,
both it and the workers computed some of every step's work.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest
from support.procs import TESTS, Coordinator, Worker, assert_losses_match

from coordinator import train_locally
from coordinator.jobs.tiny_gpt import make_job as make_tiny_gpt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _ledger(state: Path) -> dict[str, int]:
    with sqlite3.connect(state / "ledger.sqlite") as db:
        return dict(db.execute("SELECT name, tiles FROM contributions").fetchall())


def test_the_quick_start_run_plans_with_the_cost_model(tmp_path: Path) -> None:
    # What `make demo` runs: local workers share this machine, so the coordinator keeps
    # no share (auto) and every offloaded GEMM goes to them, cut as the cost model says.
    steps = 6
    coord = Coordinator(
        tmp_path, "--planner", "cost", "--steps", str(steps), "--local-workers", "2"
    )
    assert coord.wait(180) == 0, coord.output()
    out = coord.output()
    assert "planner:         cost model; every tile goes to workers" in out
    records = coord.steps()
    assert_losses_match([r["loss"] for r in records], train_locally(make_tiny_gpt(), steps))
    assert all(r["tiles"] > 0 for r in records), records
    assert sum(_ledger(coord.state).values()) == sum(r["tiles"] for r in records)
    assert "computed here" not in out


def test_a_coordinator_share_and_two_workers_train_together(tmp_path: Path) -> None:
    steps = 5
    coord = Coordinator(
        tmp_path,
        "--planner",
        "cost",
        "--coordinator-gflops",
        "20",
        "--steps",
        str(steps),
        "--min-workers",
        "2",
    )
    # Fast enough to be sent tiles whatever this machine measures: the planner's first
    # plans rest on the speed a worker reports.
    workers = [
        Worker(
            tmp_path,
            coord.url,
            name,
            program=TESTS / "support" / "fixed_speed_worker.py",
            env={"CLEAVE_GFLOPS": "200"},
        )
        for name in ("w1", "w2")
    ]
    try:
        assert coord.wait(180) == 0, coord.output()
    finally:
        for worker in workers:
            worker.stop()
    out = coord.output()
    assert "this machine computes a share (20 GFLOP/s)" in out
    records = coord.steps()
    assert_losses_match([r["loss"] for r in records], train_locally(make_tiny_gpt(), steps))
    found = re.search(r"tiles: (\d+) verified from workers, (\d+) computed here", out)
    assert found is not None, out
    verified, kept = map(int, found.groups())
    assert verified > 0 and kept > 0, out
    assert verified == sum(r["tiles"] for r in records) == sum(_ledger(coord.state).values())
