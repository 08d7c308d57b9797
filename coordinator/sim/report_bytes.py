"""Section (a): bytes per step, Cleave's closed form against tensor parallelism, and the
closed form checked against the simulated engine."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from coordinator.plan.planner import Grid, PlanConfig
from coordinator.sim.baselines import tensor_parallel_step_bytes
from coordinator.sim.config import SimConfig
from coordinator.sim.engine import simulate
from coordinator.sim.models import MODELS, step_stages
from coordinator.sim.population import make_pool
from coordinator.sim.report_common import CAMPUS, CMD, SEED, grid_for, table
from coordinator.sim.svg import line_chart


def cached_sends(grid: Grid, n: int, tile_down_bytes: int, budget: int) -> tuple[int, int]:
    """How many times each A block and each B block goes out with the operand cache, when
    tile t of the GEMM (index order, K fastest, then N, M, batch) goes to device t mod n.

    That is how one `Scheduler.assign` call deals tiles to idle workers (the server's
    mirror of a cache changes only when a tile is sent, after the call); later calls
    mostly find one worker ready, which takes a tile of the same GEMM whose block it
    holds if one is among the next few, so the server sends at most about this. The
    tiles of an A block (bi, mi, ki) are an arithmetic run with stride gk, gn of them:
    they land on min(gn, n / gcd(gk, n)) distinct devices; a B block's (bi, ki, ni) have
    stride gn gk, gm of them: min(gm, n / gcd(gn gk, n)) devices. A device holds a block
    from one use to the next if the tiles it gets in between (lcm(stride, n) / n - 1 of
    them, each at most `tile_down_bytes` new) fit its LRU budget; otherwise every use
    sends it again."""
    _, gm, gn, gk = grid

    def sends(uses: int, stride: int) -> int:
        devices = min(uses, n // math.gcd(stride, n))
        between = math.lcm(stride, n) // n  # the device's tiles from one use to the next
        return devices if between * tile_down_bytes <= budget else uses

    return sends(gn, gk), sends(gm, gn * gk)


def cleave_step_bytes(
    model: str,
    batch: int,
    seq: int,
    n: int,
    cache_budget: int | None = None,
    tile_cap: int = PlanConfig.tile_mem_cap_bytes,
) -> tuple[float, float]:
    """Total (down, up) bytes of one step with plan_gemm's grids for n workers.

    Closed form from the grid: without the cache (cache_budget None) every A element goes
    out once per N part, every B element once per M part, every output element comes
    back once per K part; with it, A and B go out `cached_sends` times instead."""
    down = up = 0.0
    for stage in step_stages(MODELS[model], batch, seq):
        for _, s in stage:
            grid = grid_for(s, n, tile_cap)
            if grid is None:
                continue
            gb, gm, gn, gk = grid
            send_a, send_b = gn, gm
            if cache_budget is not None:
                tile = (
                    s.itemsize
                    * -(-s.batch // gb)
                    * (-(-s.m // gm) * -(-s.k // gk) + -(-s.k // gk) * -(-s.n // gn))
                )
                send_a, send_b = cached_sends(grid, n, tile, cache_budget)
            down += s.itemsize * s.batch * (s.m * s.k * send_a + s.k * s.n * send_b)
            up += s.itemsize * s.batch * s.m * s.n * gk
    return down, up


TILE_CAP = PlanConfig.tile_mem_cap_bytes  # 256 MiB: table (a)'s tile cap and cache budget
VALIDATE_N = (1, 4, 16, 64)


def section_bytes(out: list[str], svgs: dict[str, str]) -> None:
    model, batch, seq = "opt-1.3b", 8, 2048
    rows, validation = [], []
    pts: dict[str, list[tuple[float, float]]] = {
        "Cleave": [],
        "Cleave + operand cache": [],
        "tensor parallel": [],
    }
    # The simulated engine on a pool whose memory caps are all the tile cap, so that its
    # grids and cache budgets are the closed form's.
    uniform = replace(CAMPUS, mem_caps=(TILE_CAP,))
    for n in (1, 4, 16, 64, 256, 1024, 4096):
        down, up = cleave_step_bytes(model, batch, seq, n)
        cached, _ = cleave_step_bytes(model, batch, seq, n, cache_budget=TILE_CAP)
        per_dev, per_dev_cached = (down + up) / n, (cached + up) / n
        tp = 2 * tensor_parallel_step_bytes(MODELS[model], batch, seq, n)  # sent + received
        rows.append(
            [
                n,
                f"{per_dev / 1e9:.2f}",
                f"{(down + up) / 1e9:.1f}",
                f"{per_dev_cached / 1e9:.2f}",
                f"{(cached + up) / 1e9:.1f}",
                f"{1 - cached / down:.0%}",
                f"{tp / 1e9:.2f}",
            ]
        )
        pts["Cleave"].append((n, per_dev / 1e9))
        pts["Cleave + operand cache"].append((n, per_dev_cached / 1e9))
        if n > 1:
            pts["tensor parallel"].append((n, tp / 1e9))
        if n in VALIDATE_N:
            config = SimConfig(model=model, batch=batch, seq=seq)
            r = simulate(config, make_pool(n, SEED, uniform))
            assert r["down_bytes"] + r["saved_bytes"] == down, "closed form != engine"
            validation.append(
                [
                    n,
                    f"{down / 1e9:.1f}",
                    f"{cached / 1e9:.1f}",
                    f"{r['down_bytes'] / 1e9:.1f}",
                    f"{r['down_bytes'] / cached - 1:+.1%}",
                ]
            )
    out += _bytes_text(model, batch, seq, rows, validation)
    svgs["bytes_per_device.svg"] = line_chart(
        f"Per-device bytes per step ({model})",
        "devices N",
        "GB per device per step",
        pts,
        log_x=True,
        log_y=True,
    )


def _bytes_text(
    model: str, batch: int, seq: int, rows: list[list[Any]], validation: list[list[Any]]
) -> list[str]:
    return [
        "## (a) Per-device bytes per step against N",
        "",
        f"`{CMD}` — {model}, batch {batch} x seq {seq}, fp32 on the wire. Cleave: the "
        "planner's grids (target 2N tiles, 256 MiB tile cap), bytes counted in closed form "
        "from each grid, spread evenly over N devices (down + up). With the operand cache "
        "(`report.cached_sends`): tile t of each GEMM goes to device t mod N, which is how "
        "one `assign` call deals tiles to idle workers (later calls mostly find one device "
        "ready, which takes a tile of the same GEMM whose block it holds if one is among "
        "the next 16: the simulated column below sends less); each device keeps the "
        "blocks it was sent (budget 256 MiB, the smallest memory cap that takes these "
        "tiles, LRU), and an A or B block goes out once per device that gets one of its "
        "tiles. Only the "
        "downlink shrinks; results come back as before. Tensor parallelism: 4 ring "
        "all-reduces per layer of batch x seq x hidden, sent + received.",
        "",
        table(
            [
                "N",
                "Cleave GB/device",
                "Cleave GB total",
                "+ cache GB/device",
                "+ cache GB total",
                "downlink saved",
                "TP GB/device",
            ],
            rows,
        ),
        "",
        "The closed form against the simulated engine (the real Scheduler with its "
        "affinity rule, the server's cache mirror) for the same step on a campus pool "
        "whose devices all have 256 MiB memory caps (seed 1): downlink GB per step. Without "
        "the cache the two agree to the byte (checked when the report runs).",
        "",
        table(
            ["N", "no cache", "cache, closed form", "cache, simulated", "simulated / closed"],
            validation,
        ),
        "",
        "![bytes](sim/bytes_per_device.svg)",
        "",
    ]
