"""The core-per-tile benchmark's code path (bench/bench_core.py) at small scale: every
result it sends is credited, and the tiles in the pool all stay out; its timings are
measured there, never asserted here."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_core import Pool, per_tile, plan_seconds, storm_seconds  # noqa: E402


def test_the_tiles_stay_out_and_each_result_is_credited() -> None:
    pool = Pool(workers=40, backlog=0.75)
    pool.submit(pool.tiles)
    assert len(pool.out) == 60  # fewer tiles than slots: every one goes out at once
    assert pool.core.scheduler.queued_count() == 0
    rng = random.Random(1)
    for _ in range(300):
        pool.result(rng)
    assert pool.core.counters.tiles_verified == 300
    assert len(pool.out) == 60
    pool.core.scheduler.check_invariants()


def test_a_run_measures_the_tiles_it_was_asked_for() -> None:
    assert per_tile(workers=20, tiles=200, backlog=0.25) > 0


def test_a_planning_run_plans_the_gemms_it_was_asked_for() -> None:
    assert plan_seconds(workers=5, gemms=2) > 0


def test_a_storm_measures_joins_and_leaves() -> None:
    join, leave = storm_seconds(workers=30)
    assert join > 0 and leave > 0
