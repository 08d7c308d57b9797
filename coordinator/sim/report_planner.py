"""Section (d): the planners' makespans against the lower bound total work / total speed."""

from __future__ import annotations

import math
from dataclasses import replace

from coordinator.plan.estimates import DeviceEstimate, LinkModel
from coordinator.plan.live import Planner
from coordinator.plan.placement import PoolPlan, candidate_configs, place_tiles, plan_for_pool
from coordinator.plan.planner import GemmShape, PlanConfig, plan_gemm
from coordinator.sim.config import SimConfig
from coordinator.sim.engine import gemm_makespans
from coordinator.sim.population import Device, PoolSpec, make_pool
from coordinator.sim.report_common import CMD, HOME, SEED, grid_for, table
from coordinator.sim.svg import line_chart

# Volunteers without GPUs: laptop and desktop CPUs, 20 GFLOP/s to 2 TFLOP/s (100x).
CPUS = PoolSpec(median_gflops=200.0, gflops_sigma=0.8, min_gflops=20.0, max_gflops=2000.0)
PLANNER_SHAPES = {
    "q proj fwd": GemmShape("mm", 1, 16384, 2048, 2048, 4),
    "fc1 fwd": GemmShape("mm", 1, 16384, 8192, 2048, 4),
    "fc2 dW": GemmShape("mm", 1, 8192, 2048, 16384, 4),
    "scores bmm": GemmShape("bmm", 256, 2048, 2048, 64, 4),
}
COORDINATOR_FLOPS = 500e9
# (per-device down and up bytes/s, None: the population's own; coordinator egress)
PLANNER_LINKS: dict[str, tuple[float | None, float]] = {
    "unlimited": (math.inf, math.inf),
    "10 Gbit/s LAN": (1.25e9, 12.5e9),
    "home": (None, 1.25e9),
}


def planner_row(
    shapes: dict[str, GemmShape], devices: list[Device], link: float | None, egress: float
) -> dict[str, float]:
    """The planner and the pull baseline on one pool: makespans summed over `shapes`."""
    ests = [
        DeviceEstimate(
            d.device_id, d.true_flops, link or d.down_bps, link or d.up_bps, d.mem_cap_bytes
        )
        for d in devices
    ]
    links = LinkModel(window=2, egress_bps=egress)
    total = dict.fromkeys(("planner", "bound", "pull", "local", "worst"), 0.0)
    total.update(kept=0.0, tiles=0.0)

    def planned(shape: GemmShape, rule: str, tiles_per_device: int) -> PoolPlan:
        return plan_for_pool(
            shape,
            ests,
            local_flops_per_s=COORDINATOR_FLOPS,
            links=links,
            share_local=True,
            tiles_per_device=tiles_per_device,
            configs=candidate_configs(PlanConfig()),
            rule=rule,
        )

    # The live code on the simulated clock: LivePlanning's default ("auto") with the
    # scheduler following the plan, and what the server ran before (pull's plan, pulled).
    pool_devices = [replace(d, down_bps=link, up_bps=link) for d in devices] if link else devices
    live = SimConfig(
        planner=Planner.COST,
        coordinator_gflops=COORDINATOR_FLOPS / 1e9,
        coordinator_egress_bps=egress,
    )
    total["executed"] = sum(gemm_makespans(live, pool_devices, list(shapes.values())))
    before = replace(live, placement="pull", follow_plan=False)
    total["executed_pull"] = sum(gemm_makespans(before, pool_devices, list(shapes.values())))
    for shape in shapes.values():
        pool = planned(shape, "finish", 8)
        total["planner"] += pool.makespan
        total["bound"] += pool.lower_bound
        total["local"] += pool.local_seconds
        total["worst"] = max(total["worst"], pool.makespan / pool.lower_bound)
        total["kept"] += len(pool.local_tiles)
        total["tiles"] += len(pool.placements)
        # What the server did before the cost model: plan_gemm's grid for the pool size,
        # each tile to whichever worker has a free slot, nothing kept here.
        cap = min(min(d.mem_cap_bytes for d in devices), PlanConfig.tile_mem_cap_bytes)
        grid = grid_for(shape, len(devices), cap)
        if grid is None:
            total["pull"] += pool.local_seconds
            continue
        plan = plan_gemm(
            shape, PlanConfig(target_tiles=max(2, 2 * len(devices)), tile_mem_cap_bytes=cap)
        )
        assert plan is not None
        placed = place_tiles(shape, plan.tiles, ests, links=links, rule="pull")
        assert placed is not None
        total["pull"] += max(p.finish for p in placed)
    return total


def section_planner(out: list[str], svgs: dict[str, str]) -> None:
    rows = []
    series: dict[str, list[tuple[float, float]]] = {}
    for pool_name, spec in (("CPUs", CPUS), ("CPUs + GPUs", HOME)):
        for link_name, (link, egress) in PLANNER_LINKS.items():
            for n in (2, 4, 16, 64):
                t = planner_row(PLANNER_SHAPES, make_pool(n, SEED, spec), link, egress)
                bound = t["bound"]
                rows.append(
                    [
                        pool_name,
                        link_name,
                        n,
                        f"{t['planner'] / bound:.2f}",
                        f"{t['worst']:.2f}",
                        f"{t['kept']:.0f} / {t['tiles']:.0f}",
                        f"{t['executed'] / bound:.2f}",
                        f"{t['executed_pull'] / bound:.2f}",
                        f"{t['pull'] / bound:.2f}",
                        f"{t['local'] / bound:.2f}",
                    ]
                )
                series.setdefault(f"{pool_name}, {link_name}", []).append((n, t["planner"] / bound))
    out += [
        "## (d) Planner makespan vs the lower bound total work / total speed",
        "",
        f"`{CMD}` — the GEMMs q proj fwd, fc1 fwd, fc2 dW and the attention scores bmm of "
        "OPT-1.3B at batch 8 x seq 2048 (fp32), one after another, on seeded pools: "
        "'CPUs' 20 GFLOP/s-2 TFLOP/s (median 200), 'CPUs + GPUs' 5 GFLOP/s-100 TFLOP/s. "
        "Links: 'unlimited' (scheduling alone), '10 Gbit/s LAN' (every device; the "
        "coordinator's uplink 100 Gbit/s), 'home' (the population's links, median "
        "100 Mbit/s down, uplink 2-10x slower; coordinator 10 Gbit/s). The planner is "
        "`placement.plan_for_pool`: grids from `plan_gemm` under the limits of "
        "`candidate_configs` (bigger tiles, K splits for long K) with up to 8 tiles per "
        "device, list scheduling by earliest estimated finish with operand-block reuse, "
        "workers pipelined with the server's prefetch window of 2, and the coordinator "
        f"({COORDINATOR_FLOPS / 1e9:.0f} GFLOP/s, no link) taking a share. True speeds "
        "serve as the estimates. Bound = total FLOPs / (sum of the devices' FLOP/s + the "
        "coordinator's), summed over the four GEMMs. 'live, executed' is what the "
        "server does, run on the simulated clock (`engine.gemm_makespans`: the real "
        "`LivePlanning` and `Scheduler`, speeds and links known): up to 4 tiles per "
        "device, placed by earliest finish and the tickets naming their worker "
        "(`TileTicket.planned_for`; steals only when clearly sooner) where compute binds "
        "or following gains 2x, pull's plan otherwise (`LivePlanning.rule` 'auto'). "
        "'pull plan pulled' is the server before this: grids placed as pull would hand "
        "them out, each tile to the first free slot. 'old' is the server before the "
        "cost model: `plan_gemm` for 2N tiles, pulled, nothing computed at the "
        "coordinator (predicted).",
        "",
        table(
            [
                "pool",
                "links",
                "N",
                "planner / bound",
                "worst GEMM",
                "tiles kept at coordinator",
                "live, executed / bound",
                "pull plan pulled, executed / bound",
                "old (grid, pull) / bound",
                "coordinator alone / bound",
            ],
            rows,
        ),
        "",
        "![planner](sim/planner_ratio.svg)",
        "",
    ]
    svgs["planner_ratio.svg"] = line_chart(
        "Planner makespan / lower bound", "devices N", "ratio", series, log_x=True
    )
