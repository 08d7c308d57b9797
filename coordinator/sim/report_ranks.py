"""Section (f) of the report: what coordinator ranks buy for 1,000 and 10,000 workers."""

from __future__ import annotations

from typing import Any

from coordinator.plan.live import Planner
from coordinator.sim.report_common import CAMPUS, CMD, run_pool, table
from coordinator.sim.svg import line_chart

# The coordinator's CPU per tile, from the benches (docs/benchmarks.md): the load bench's
# CPU per verified 64³ fp32 tile, less that tile's 48 KiB at the per-byte cost; and the
# built-in GPT's orchestration CPU per step over the tile bytes it sent and received
# (bench/bench_step.py). Both on this project's 2-core machine.
CPU_PER_TILE_S = 550e-6
CPU_PER_BYTE_S = 1e-9
POOLS = ((1000, (1, 2, 4, 8)), (10_000, (8, 16, 32)))
BASE: dict[str, Any] = {
    "model": "opt-125m",
    "batch": 32,
    "seq": 512,
    "coordinator_cpu_per_tile_s": CPU_PER_TILE_S,
    "coordinator_cpu_per_byte_s": CPU_PER_BYTE_S,
}


def section_ranks(out: list[str], svgs: dict[str, str]) -> None:
    rows: list[list[Any]] = []
    series: dict[str, list[tuple[float, float]]] = {}
    for n, ranks in POOLS:
        for r in ranks:
            row: list[Any] = [f"{n:,}", r, n // r]
            # The grid planner learns nothing between steps: one is its every step.
            for planner, steps in ((Planner.GRID, 1), (Planner.COST, 2)):
                res = run_pool(n, CAMPUS, planner=planner, steps=steps, ranks=r, **BASE)
                step = res["step_times_s"][-1]
                cpu = res["coordinator_cpu_s"] / len(res["step_times_s"])
                sent = 1 - res["local_flops"] / (res["flops_per_step"] * len(res["step_times_s"]))
                row += [
                    f"{step:.1f}",
                    f"{cpu:.1f}",
                    f"{min(1.0, cpu / step):.0%}" if step else "-",
                    f"{res['down_bytes'] / len(res['step_times_s']) / 1e9:.1f}",
                    f"{sent:.0%}",
                ]
                series.setdefault(f"{n:,} workers, {planner.value} planner", []).append((r, step))
            row.append(f"{res['allreduce_s']:.2f}")
            rows.append(row)
    header = ["workers", "ranks", "workers/rank"]
    for label in (Planner.GRID.value, Planner.COST.value):
        header += [
            f"{label}: step s",
            f"{label}: CPU s/rank",
            f"{label}: CPU busy",
            f"{label}: GB out/rank",
            f"{label}: sent",
        ]
    header.append("all-reduce s")
    out += [
        "## (f) Coordinator ranks for 1,000 and 10,000 workers",
        "",
        f"`{CMD}` — opt-125m, global batch 32 x seq 512, fp32, campus links (median "
        "downlink 1 Gbit/s), the devices of table (b). R coordinator ranks "
        "(`SimConfig.ranks`): each has its own 10 Gbit/s egress and one core of CPU, "
        "serves the devices dealt to it in turn (as the front door spreads joining "
        "workers) and trains on its 32/R rows of the batch; after the backward the "
        "gradients (124M fp32 weights) are all-reduced in a ring over a 10 Gbit/s link "
        "between the ranks. The ranks are alike, so rank 0 is simulated with its devices. "
        "The coordinator's CPU is modelled here (sections a-e leave it out): "
        f"{CPU_PER_TILE_S * 1e6:.0f} µs per tile handed out plus {CPU_PER_BYTE_S * 1e9:.0f} "
        "ns per byte sent or received, on one core, before the tile's download starts, "
        "from the load and step benches (`coordinator/sim/report_ranks.py`); the cost "
        "planner counts the per-tile part. Grid: `plan_gemm`, every GEMM sent in 2N/R "
        "tiles. Cost: the live default, the coordinator (500 GFLOP/s) keeping what it "
        "finishes first. Its second step is shown (the first assumes unmeasured links "
        "are fast); CPU s/rank: the rank's CPU per step on tiles; CPU busy: that "
        "over the step; sent: the share of the step's FLOPs given to devices.",
        "",
        table(header, rows),
        "",
        "![step time against ranks](sim/ranks.svg)",
        "",
    ]
    svgs["ranks.svg"] = line_chart(
        "Step time against coordinator ranks (opt-125m, batch 32 x 512)",
        "coordinator ranks",
        "seconds per step",
        series,
        log_x=True,
        log_y=True,
    )
