"""How long a tile takes on each worker, and a planner that uses it on mixed pools.

Pure: no torch, no I/O, time comes in as `now`. A worker starts from what it says at
join (GFLOP/s measured at start-up, its memory cap) and link speeds the caller guesses;
every finished tile then moves the estimates toward what was observed, so a worker that
overstated its speed, or got busy, is found out after a few tiles.

A tile's time is modelled as three phases in a row, each bounded by one resource:

    operand bytes / downlink  +  flops / compute speed  +  result bytes / uplink

`plan_for_pool` picks, for one GEMM, offload vs local and the tile grid (candidates come
from `planner.plan_gemm`, so batch splits, then M x N, and K only where a memory cap
demands it) by placing each candidate's tiles, largest first, on the worker that would
finish it earliest (list scheduling), and keeping the grid with the smallest makespan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.messages import DeviceProfile
from coordinator.planner import GemmPlan, GemmShape, PlanConfig, TileRegion, plan_gemm

# A worker that reports no measurement still gets work; 1 GFLOP/s is a slow laptop core,
# so the first tiles it gets are small in the plan and its real speed is learnt from them.
UNMEASURED_FLOPS_PER_S = 1e9

Block = tuple[str, int, int, int]  # ("A", bi, mi, ki) or ("B", bi, ni, ki)
DEFAULT_PLAN = PlanConfig()


@dataclass(frozen=True)
class DeviceEstimate:
    worker_id: str
    flops_per_s: float
    down_bps: float  # coordinator -> worker bytes/s
    up_bps: float  # worker -> coordinator bytes/s
    mem_cap_bytes: int | None = None  # None: no cap
    updated_at: float = 0.0

    def __post_init__(self) -> None:
        if min(self.flops_per_s, self.down_bps, self.up_bps) <= 0:
            raise ValueError(f"{self.worker_id}: speeds must be > 0")

    def tile_seconds(self, flops: int, down_bytes: int, up_bytes: int) -> float:
        return down_bytes / self.down_bps + flops / self.flops_per_s + up_bytes / self.up_bps

    def can_hold(self, tile_bytes: int) -> bool:
        return self.mem_cap_bytes is None or tile_bytes <= self.mem_cap_bytes


def from_profile(
    worker_id: str, profile: DeviceProfile, *, down_bps: float, up_bps: float, now: float
) -> DeviceEstimate:
    """The estimate at join: the worker's own measurement, the caller's link guesses."""
    flops = profile.gflops * 1e9 if profile.gflops > 0 else UNMEASURED_FLOPS_PER_S
    cap = profile.mem_cap_bytes if profile.mem_cap_bytes > 0 else None
    return DeviceEstimate(worker_id, flops, down_bps, up_bps, cap, now)


@dataclass(frozen=True)
class TileObservation:
    """One finished tile. A phase whose duration was not measured (None or <= 0) leaves
    that rate alone: a zero-byte transfer says nothing about the link."""

    flops: int
    down_bytes: int
    up_bytes: int
    down_s: float | None
    compute_s: float | None
    up_s: float | None


def observe(
    estimate: DeviceEstimate,
    obs: TileObservation,
    now: float,
    *,
    alpha: float = 0.3,
    half_life_s: float = 60.0,
) -> DeviceEstimate:
    """Move each rate toward the observed one (EWMA on rates).

    Back-to-back tiles weigh `alpha` each; an estimate that has not been updated for a
    while is trusted less (its weight halves every `half_life_s`), because the machine's
    load may have changed since.
    """
    if not 0 < alpha <= 1 or half_life_s <= 0:
        raise ValueError("alpha must be in (0, 1] and half_life_s > 0")
    stale = max(0.0, now - estimate.updated_at) / half_life_s
    weight = 1 - (1 - alpha) * 0.5**stale

    def blend(old: float, amount: int, seconds: float | None) -> float:
        if seconds is None or seconds <= 0 or amount <= 0:
            return old
        return (1 - weight) * old + weight * (amount / seconds)

    return dataclasses.replace(
        estimate,
        flops_per_s=blend(estimate.flops_per_s, obs.flops, obs.compute_s),
        down_bps=blend(estimate.down_bps, obs.down_bytes, obs.down_s),
        up_bps=blend(estimate.up_bps, obs.up_bytes, obs.up_s),
        updated_at=max(now, estimate.updated_at),
    )


def overdue_finish(start: float, expected_s: float, now: float) -> float:
    """When a tile started at `start` will be back. Once it is past its expected time the
    estimate is evidently wrong; assume it needs as long again as it has already taken
    (the doubling guess of a job whose remaining time is unknown)."""
    expected = start + expected_s
    return expected if now <= expected else now + (now - start)


def lower_bound(total_flops: int, devices: Sequence[DeviceEstimate]) -> float:
    """No schedule beats total work / total speed (communication ignored)."""
    speed = sum(d.flops_per_s for d in devices)
    if speed <= 0:
        raise ValueError("lower_bound needs at least one device")
    return total_flops / speed


@dataclass(frozen=True)
class Placement:
    tile: TileRegion
    worker_id: str
    start: float
    finish: float
    down_bytes: int  # operand bytes actually sent: blocks the worker holds are not resent


@dataclass(frozen=True)
class PoolPlan:
    plan: GemmPlan | None  # None: run the GEMM at the coordinator
    placements: tuple[Placement, ...]
    makespan: float  # estimated, from the earliest ready time
    lower_bound: float
    local_seconds: float

    @property
    def down_bytes(self) -> int:
        return sum(p.down_bytes for p in self.placements)


def operand_blocks(shape: GemmShape, tile: TileRegion) -> tuple[tuple[Block, int], ...]:
    """The A and B blocks a tile reads, with their sizes in bytes."""
    bi, mi, ni, ki = tile.index
    b, m, n, k = tile.dims
    return (
        (("A", bi, mi, ki), shape.itemsize * b * m * k),
        (("B", bi, ni, ki), shape.itemsize * b * k * n),
    )


def place_tiles(
    shape: GemmShape,
    tiles: Sequence[TileRegion],
    devices: Sequence[DeviceEstimate],
    *,
    ready_at: Mapping[str, float] | None = None,
    held: Mapping[str, frozenset[Block]] | None = None,
) -> tuple[Placement, ...] | None:
    """List scheduling: largest tile first, each to the device that finishes it earliest.

    A device that already holds one of the tile's operand blocks (sent for an earlier
    tile, or in `held`) is not sent it again, so it tends to win ties and keep a row or
    column of the grid. Ties on finish go to the device holding more of the operands,
    then to the earlier device in `devices`. None when some tile fits no device's cap.
    """
    ready = {d.worker_id: (ready_at or {}).get(d.worker_id, 0.0) for d in devices}
    holding = {d.worker_id: set((held or {}).get(d.worker_id, frozenset())) for d in devices}
    order = sorted(tiles, key=lambda t: (-t.flops, t.index))
    placements: list[Placement] = []
    for tile in order:
        blocks = operand_blocks(shape, tile)
        up = tile.up_bytes(shape.itemsize)
        size = tile.total_bytes(shape.itemsize)
        best: tuple[float, int, int] | None = None
        best_down = 0
        for i, device in enumerate(devices):
            if not device.can_hold(size):
                continue
            have = holding[device.worker_id]
            down = sum(nbytes for block, nbytes in blocks if block not in have)
            finish = ready[device.worker_id] + device.tile_seconds(tile.flops, down, up)
            key = (finish, -sum(block in have for block, _ in blocks), i)
            if best is None or key < best:
                best, best_down = key, down
        if best is None:
            return None
        device = devices[best[2]]
        start = ready[device.worker_id]
        ready[device.worker_id] = best[0]
        holding[device.worker_id].update(block for block, _ in blocks)
        placements.append(Placement(tile, device.worker_id, start, best[0], best_down))
    return tuple(placements)


def candidate_plans(
    shape: GemmShape, devices: Sequence[DeviceEstimate], base: PlanConfig
) -> list[GemmPlan]:
    """plan_gemm's grids for 1, 2, 4, ... up to 4 tiles per device, deduplicated.

    The memory cap is the largest device's (never above base's): a tile only needs one
    device that can hold it, and K is split only when even that one cannot.
    """
    caps = [d.mem_cap_bytes for d in devices]
    cap = base.tile_mem_cap_bytes
    if caps and None not in caps:
        cap = min(cap, max(c for c in caps if c is not None))
    plans: dict[tuple[int, int, int, int], GemmPlan] = {}
    target = 1
    while target <= max(1, 4 * len(devices)):
        config = dataclasses.replace(base, target_tiles=target, tile_mem_cap_bytes=cap)
        try:
            plan = plan_gemm(shape, config)
        except ValueError:
            return []  # not even a 1x1x1 tile fits: only the coordinator can run it
        if plan is None:
            return []
        plans.setdefault(plan.grid, plan)
        target *= 2
    return list(plans.values())


def plan_for_pool(
    shape: GemmShape,
    devices: Sequence[DeviceEstimate],
    *,
    local_flops_per_s: float,
    base: PlanConfig = DEFAULT_PLAN,
    ready_at: Mapping[str, float] | None = None,
    held: Mapping[str, frozenset[Block]] | None = None,
) -> PoolPlan:
    """Offload vs local and the tile grid with the smallest estimated makespan.

    Local wins ties: it moves no bytes. GEMMs below base.min_offload_flops stay local,
    as in plan_gemm. A grid whose tiles fit no device is skipped.
    """
    local = shape.flops / local_flops_per_s
    bound = lower_bound(shape.flops, devices) if devices else local
    best = PoolPlan(None, (), local, bound, local)
    if not devices:
        return best
    start = min((ready_at or {}).get(d.worker_id, 0.0) for d in devices)
    for plan in candidate_plans(shape, devices, base):
        placed = place_tiles(shape, plan.tiles, devices, ready_at=ready_at, held=held)
        if placed is None:
            continue
        makespan = max(p.finish for p in placed) - start
        better = makespan < best.makespan or (
            makespan == best.makespan
            and best.plan is not None
            and len(placed) < len(best.placements)
        )
        if better:
            best = PoolPlan(plan, placed, makespan, bound, local)
    return best
