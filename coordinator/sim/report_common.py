"""What the report's sections share: the pools, the command, table formatting."""

from __future__ import annotations

import functools
from typing import Any

from coordinator.plan.planner import GemmShape, Grid, PlanConfig, plan_gemm
from coordinator.sim.config import SimConfig
from coordinator.sim.engine import simulate
from coordinator.sim.population import PoolSpec, make_pool, with_stragglers

SEED = 1
CAMPUS = PoolSpec(median_down_mbit=1000.0, down_sigma=0.5)  # 1 Gbit/s median downlink
HOME = PoolSpec()  # 100 Mbit/s median downlink
CMD = "python -m coordinator.sim report"


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def run_pool(n: int, spec: PoolSpec, **kw: Any) -> dict[str, Any]:
    devices = make_pool(n, SEED, spec)
    stragglers = kw.pop("stragglers", 0)
    if stragglers:
        devices = with_stragglers(devices, stragglers)
    return simulate(SimConfig(**kw), devices)


@functools.cache
def grid_for(
    shape: GemmShape, n: int, tile_cap: int = PlanConfig.tile_mem_cap_bytes
) -> Grid | None:
    plan = plan_gemm(shape, PlanConfig(target_tiles=max(2, 2 * n), tile_mem_cap_bytes=tile_cap))
    return None if plan is None else plan.grid
