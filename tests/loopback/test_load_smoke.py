"""The load test's code path (bench/bench_load.py) at small scale: 30 real connections.

A coordinator process and a load process, as in the benchmark, and two coordinator
processes with a load process each (``--ranks 2``); the assertions are the benchmark's
pass conditions, not its timings (those are measured, never asserted).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_load import LoadConfig, format_table, run_load  # noqa: E402

pytestmark = pytest.mark.timeout(90)

WORKERS = 30


@pytest.mark.parametrize("ranks", [1, 2])
def test_thirty_workers_are_welcomed_beat_and_compute_every_gemm_correctly(ranks: int) -> None:
    cfg = LoadConfig(
        workers=WORKERS,
        ranks=ranks,
        seconds=2.0,
        warmup_s=0.5,
        heartbeat_s=0.25,  # several beats per worker within the short steady phase
        drain_timeout_s=20.0,
    )
    m = run_load(cfg)
    table = format_table(m)  # shown by pytest when an assertion fails

    assert m["workers_welcomed"] == m["coordinator_conns_seen"] == WORKERS, table
    assert m["workers_failed"] == [] and m["workers_dropped"] == [], table
    assert m["workers_with_acks"] == WORKERS and m["heartbeats_unacked_steady"] == 0, table
    assert m["probes"] == WORKERS // 2 and m["probe_ack_p50_ms"] > 0, table  # their own process
    assert m["worker_errors"] == {}, table

    assert m["drained"] and m["gemms_submitted"] > 0, table
    assert m["gemms_correct"] == m["gemms_submitted"] and m["gemms_wrong"] == [], table
    assert m["tiles_lost"] == 0 and m["tiles_rejected"] == 0, table
    assert m["tiles_computed_here"] == 0, table
    assert m["tiles_verified"] == m["tiles_submitted"] == 64 * m["gemms_submitted"], table
    assert m["workers_with_tiles"] == WORKERS, table
    # The coordinator's CPU per tile, by part: its stages and threads, counted by each rank.
    parts = m["cpu_us_per_tile_by_part"]
    assert {"event_loop rest", "check_on_loop", "cut", "sign", "ledger"} <= set(parts), table
    assert all(parts[k] > 0 for k in ("event_loop rest", "check_on_loop", "cut")), table
