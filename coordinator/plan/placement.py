"""A GEMM's tile grid placed on a pool of estimated devices, and the grid that finishes
first.

`plan_for_pool` picks, for one GEMM, offload vs local and the tile grid (candidates come
from `planner.plan_gemm`, so batch splits, then M x N, and K only where a memory cap
demands it) by placing each candidate's tiles, largest first, on the worker that would
finish it earliest (list scheduling), and keeping the grid with the smallest makespan.
A tile's time on a device is estimates.py's model.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from coordinator.plan.estimates import SEQUENTIAL, DeviceEstimate, LinkModel, lower_bound
from coordinator.plan.planner import (
    GemmPlan,
    GemmShape,
    Grid,
    PlanConfig,
    TileRegion,
    grid_plan,
    plan_gemm,
)

# An operand block by the ranges it covers: ("A", b0, b1, m0, m1, k0, k1) or
# ("B", b0, b1, k0, k1, n0, n1). Ranges, not grid indices, so that grids of one GEMM
# that cut an operand alike name its blocks alike (coordinator.plan.layouts).
Block = tuple[str, int, int, int, int, int, int]
Run = tuple[float, float, float, float]  # (start, download end, compute end, finish)
Choice = tuple[int, Run, int]  # (lane index, its run of the tile, operand bytes sent)
Attempt = Callable[["_Lane"], tuple[Run, int]]
DEFAULT_PLAN = PlanConfig()
# The coordinator itself, when it computes a share of a GEMM: no link to cross.
LOCAL = "coordinator"
# Queued tiles a free worker looks through for one whose operand block it holds, as the
# scheduler's PREFERENCE_LOOKAHEAD (planning does not import scheduling).
PREFERENCE_LOOKAHEAD = 16


@dataclass(frozen=True)
class Placement:
    tile: TileRegion
    worker_id: str  # LOCAL: the coordinator computes it
    start: float  # its download starts (compute, for LOCAL)
    finish: float  # its result is back
    down_bytes: int  # operand bytes actually sent: blocks the worker holds are not resent


@dataclass(frozen=True)
class PoolPlan:
    plan: GemmPlan | None  # None: run the GEMM at the coordinator
    placements: tuple[Placement, ...]
    makespan: float  # estimated, seconds from now (ready_at counted)
    lower_bound: float
    local_seconds: float

    @property
    def down_bytes(self) -> int:
        return sum(p.down_bytes for p in self.placements)

    @property
    def local_tiles(self) -> tuple[TileRegion, ...]:
        """Tiles the plan keeps at the coordinator (with `share_local`)."""
        return tuple(p.tile for p in self.placements if p.worker_id == LOCAL)


def operand_blocks(shape: GemmShape, tile: TileRegion) -> tuple[tuple[Block, int], ...]:
    """The A and B blocks a tile reads, with their sizes in bytes."""
    t = tile
    b, m, n, k = tile.dims
    return (
        (("A", t.b0, t.b1, t.m0, t.m1, t.k0, t.k1), shape.itemsize * b * m * k),
        (("B", t.b0, t.b1, t.k0, t.k1, t.n0, t.n1), shape.itemsize * b * k * n),
    )


def _attempt(
    tile: TileRegion,
    blocks: tuple[tuple[Block, int], ...],
    up: int,
    links: LinkModel,
    floor: float,
    moved: int,
    lane: _Lane,
) -> tuple[Run, int]:
    """The lane's timeline for the tile, and the operand bytes it would be sent. `moved`:
    the bytes the coordinator handled for the tiles placed before, and this one's result."""
    if lane.device.worker_id == LOCAL:  # the coordinator: no link to cross
        return lane.run(tile.flops, 0, up, links.window, 0.0), 0
    down = sum(nbytes for block, nbytes in blocks if block not in lane.held)
    floor += down / links.egress_bps + (moved + down) * links.byte_cpu_s
    return lane.run(tile.flops, down, up, links.window, floor), down


@dataclass
class _Lane:
    """One device's timeline while tiles are being placed: when its downlink, compute and
    uplink are next free, when its tiles finish (for the window), what it holds."""

    device: DeviceEstimate
    down_free: float
    comp_free: float
    up_free: float
    finishes: list[float]
    held: set[Block]

    def slot(self, window: int) -> float:
        """When the coordinator may send this device its next tile."""
        if len(self.finishes) < window:
            return self.down_free
        return max(self.down_free, self.finishes[-window])

    def run(self, flops: int, down: int, up: int, window: int, egress_floor: float) -> Run:
        """(start, download end, compute end, finish) of this device's next tile; the
        download cannot end before `egress_floor`, when the coordinator's uplink has had
        time to carry every byte sent so far plus this tile's."""
        d = self.device
        start = self.slot(window)
        down_end = max(start + down / d.down_bps, egress_floor)
        comp_end = max(down_end, self.comp_free) + flops / d.flops_per_s
        finish = max(comp_end, self.up_free) + up / d.up_bps
        return start, down_end, comp_end, finish

    def take(self, run: Run, blocks: tuple[tuple[Block, int], ...]) -> None:
        """Book the tile `run` describes on this lane; the lane now holds its blocks."""
        _, self.down_free, self.comp_free, self.up_free = run
        self.finishes.append(self.up_free)
        self.held.update(block for block, _ in blocks)


def _pull_choice(
    lanes: Sequence[_Lane],
    slots: list[tuple[float, int]],
    here: Sequence[int],
    size: int,
    attempt: Attempt,
) -> Choice | None:
    """Rule "pull": the worker with the earliest free slot that can hold the tile, unless
    a lane with no link (`here`) would finish it no later. The chosen worker's slot is
    popped; the caller pushes its next one."""
    skipped = []
    while slots and not lanes[slots[0][1]].device.can_hold(size):
        skipped.append(heapq.heappop(slots))
    choice: Choice | None = None
    if slots:
        run, down = attempt(lanes[slots[0][1]])
        choice = (slots[0][1], run, down)
    for i in here:
        run, _ = attempt(lanes[i])
        if choice is None or run[3] <= choice[1][3]:
            choice = (i, run, 0)
    if choice is not None and choice[0] not in here:
        heapq.heappop(slots)
    for entry in skipped:
        heapq.heappush(slots, entry)
    return choice


def _preferred(
    shape: GemmShape, lane: _Lane, head: TileRegion, pending: collections.deque[TileRegion]
) -> TileRegion:
    """The tile pull hands the worker with the earliest free slot: the head of the queue,
    or, where it holds none of the head's operand blocks, the first of the next few that
    it holds one of and can hold (which then leaves `pending`; the head goes back to its
    front). The scheduler prefers so too (coordinator.schedule.assignment), which keeps
    a block sent for one tile, or for an earlier GEMM, at the worker that holds it."""
    if not lane.held or any(block in lane.held for block, _ in operand_blocks(shape, head)):
        return head
    for i, tile in enumerate(itertools.islice(pending, PREFERENCE_LOOKAHEAD)):
        if any(block in lane.held for block, _ in operand_blocks(shape, tile)):
            if lane.device.can_hold(tile.total_bytes(shape.itemsize)):
                del pending[i]
                pending.appendleft(head)
                return tile
    return head


def _finish_choice(
    lanes: Sequence[_Lane], blocks: tuple[tuple[Block, int], ...], size: int, attempt: Attempt
) -> Choice | None:
    """Rule "finish": the lane that would finish the tile first; ties to the lane holding
    more of its operand blocks, then to the earlier lane."""
    best: tuple[float, int, int] | None = None
    choice: Choice | None = None
    for i, lane in enumerate(lanes):
        if not lane.device.can_hold(size):
            continue
        run, down = attempt(lane)
        key = (run[3], -sum(b in lane.held for b, _ in blocks), i)
        if best is None or key < best:
            best, choice = key, (i, run, down)
    return choice


def place_tiles(
    shape: GemmShape,
    tiles: Sequence[TileRegion],
    devices: Sequence[DeviceEstimate],
    *,
    ready_at: Mapping[str, float] | None = None,
    held: Mapping[str, frozenset[Block]] | None = None,
    links: LinkModel = SEQUENTIAL,
    rule: str = "finish",
    beat: float = math.inf,
) -> tuple[Placement, ...] | None:
    """Place tiles on devices one at a time. None when some tile fits no device's cap,
    or as soon as one would finish after `beat`: a placement's makespan only grows as
    tiles are placed, so it could no longer beat a plan that finishes by then.

    rule "finish" (the planner): largest tile first, each to the device that finishes it
    earliest (list scheduling). A device that already holds one of the tile's operand
    blocks (sent for an earlier tile, or in `held`) is not sent it again, so it tends to
    win and keep a row or column of the grid; ties go to the device holding more of the
    operands, then to the earlier device in `devices`.

    rule "pull" (what the server's scheduler does): tiles in grid order, each to the
    device with the earliest free slot, however slow it is, which takes one of the next
    few whose operand block it holds before the head (`_preferred`); a device with no
    link (the coordinator, LOCAL) takes a tile instead when it would finish it no later.
    """
    if rule not in ("finish", "pull"):
        raise ValueError(f"unknown rule {rule!r}")
    lanes = []
    for d in devices:
        ready = (ready_at or {}).get(d.worker_id, 0.0)
        have = set((held or {}).get(d.worker_id, frozenset()))
        lanes.append(_Lane(d, ready, ready, ready, [], have))
    order = sorted(tiles, key=lambda t: (-t.flops, t.index)) if rule == "finish" else tiles
    t0 = min((lane.down_free for lane in lanes), default=0.0)
    sent = 0  # bytes through the coordinator's uplink so far (a shared fluid pipe)
    moved = 0  # bytes the coordinator's CPU handled so far: operands sent, results back
    remote = 0  # tiles sent to workers so far
    # Pull: workers by their next free slot, so each tile costs log(devices), not devices.
    # The coordinator (no link) pulls nothing: it keeps a tile when it would finish it
    # before the worker that would pull it.
    here = [i for i, lane in enumerate(lanes) if lane.device.worker_id == LOCAL]
    slots = [(lane.slot(links.window), i) for i, lane in enumerate(lanes) if i not in here]
    heapq.heapify(slots)
    placements: list[Placement] = []
    pending = collections.deque(order)
    while pending:
        tile = pending.popleft()
        if rule == "pull" and slots:
            tile = _preferred(shape, lanes[slots[0][1]], tile, pending)
        blocks = operand_blocks(shape, tile)
        size = tile.total_bytes(shape.itemsize)
        # A download cannot end before the coordinator's uplink carried it and the bytes
        # placed before it, and spent its per-tile work on it and on the tiles before.
        floor = t0 + sent / links.egress_bps + (remote + 1) * links.tile_overhead_s
        up = tile.up_bytes(shape.itemsize)
        attempt = functools.partial(_attempt, tile, blocks, up, links, floor, moved + up)
        if rule == "pull":
            choice = _pull_choice(lanes, slots, here, size, attempt)
        else:
            choice = _finish_choice(lanes, blocks, size, attempt)
        if choice is None:
            return None
        chosen, run, down = choice
        if run[3] > beat:
            return None
        lane = lanes[chosen]
        lane.take(run, blocks)
        sent += down
        if lane.device.worker_id != LOCAL:
            remote += 1
            moved += down + up
        if rule == "pull" and chosen not in here:
            heapq.heappush(slots, (lane.slot(links.window), chosen))
        placements.append(Placement(tile, lane.device.worker_id, run[0], run[3], down))
    return tuple(placements)


@functools.lru_cache(maxsize=256)  # called for every GEMM planned, with a few configs
def candidate_configs(base: PlanConfig) -> tuple[PlanConfig, ...]:
    """Tile limits to try besides base's. Bigger tiles (4x and 16x the FLOP limit) carry
    more FLOPs per byte sent, which fast devices on slow links need; a smallest side of
    1024 makes a long-K GEMM split K instead of cutting M and N into thin strips whose
    operands are mostly K. List scheduling keeps big tiles off slow devices."""
    configs = [base]
    for flops_factor, side in ((1, 1024), (4, 256), (4, 1024), (16, 1024)):
        configs.append(
            dataclasses.replace(
                base,
                max_tile_flops=base.max_tile_flops * flops_factor,
                min_tile_side=max(base.min_tile_side, side),
            )
        )
    return tuple(dict.fromkeys(configs))


@functools.lru_cache(maxsize=4096)  # equal configs: plan_gemm's cache finds their plans
def _grown(config: PlanConfig, target: int, cap: int) -> PlanConfig:
    return dataclasses.replace(config, target_tiles=target, tile_mem_cap_bytes=cap)


def candidate_plans(
    shape: GemmShape,
    devices: Sequence[DeviceEstimate],
    base: PlanConfig,
    *,
    tiles_per_device: int = 4,
    configs: Sequence[PlanConfig] | None = None,
) -> list[GemmPlan]:
    """plan_gemm's grids for 1, 2, 4, ... up to `tiles_per_device` tiles per device, for
    each of `configs` (default: base alone), deduplicated. More tiles balance mixed
    speeds better and re-send more operands.

    The memory cap is the largest device's (never above the config's): a tile only needs
    one device that can hold it, and K is split only when even that one cannot.
    """
    plans: dict[tuple[int, int, int, int], GemmPlan] = {}
    for config in configs or [base]:
        cap = _largest_cap(devices, config)
        target = 1
        while target <= max(1, tiles_per_device * len(devices)):
            grown = _grown(config, target, cap)
            try:
                plan = plan_gemm(shape, grown)
            except ValueError:
                return []  # not even a 1x1x1 tile fits: only the coordinator can run it
            if plan is None:
                return []
            plans.setdefault(plan.grid, plan)
            target *= 2
    return list(plans.values())


def _largest_cap(devices: Sequence[DeviceEstimate], config: PlanConfig) -> int:
    """The memory cap a tile must fit: the largest device's, never above the config's."""
    caps = [d.mem_cap_bytes for d in devices]
    if caps and None not in caps:
        return min(config.tile_mem_cap_bytes, max(c for c in caps if c is not None))
    return config.tile_mem_cap_bytes


def plans_on_grids(
    shape: GemmShape,
    devices: Sequence[DeviceEstimate],
    grids: Sequence[Grid],
    configs: Sequence[PlanConfig],
) -> list[GemmPlan]:
    """Plans on exactly these grids (``planner.grid_plan``), each where one of `configs`
    allows it, capped as candidate_plans caps them."""
    plans = []
    for grid in grids:
        for config in configs:
            cap = _largest_cap(devices, config)
            plan = grid_plan(shape, grid, _grown(config, config.target_tiles, cap))
            if plan is not None:
                plans.append(plan)
                break
    return plans


def plan_for_pool(
    shape: GemmShape,
    devices: Sequence[DeviceEstimate],
    *,
    local_flops_per_s: float,
    base: PlanConfig = DEFAULT_PLAN,
    ready_at: Mapping[str, float] | None = None,
    held: Mapping[str, frozenset[Block]] | None = None,
    links: LinkModel = SEQUENTIAL,
    share_local: bool = False,
    tiles_per_device: int = 4,
    configs: Sequence[PlanConfig] | None = None,
    rule: str = "finish",
    grids: Sequence[GemmPlan] | None = None,
    later: Callable[[GemmPlan], float] | None = None,
    byte_cost_s: float = 0.0,
    cpu_slack: float = 1.0,
) -> PoolPlan:
    """Offload vs local, and the tile grid: the one with the smallest estimated makespan,
    or, where the coordinator's CPU is counted, the cheapest near it (below).

    With `share_local` the coordinator is one more device in the placement (worker id
    LOCAL, no link to cross), so a plan may keep some tiles here and send the rest: on a
    pool whose links cannot carry a whole GEMM's operands in time, the coordinator does
    what the links cannot feed. Its speed then counts in the lower bound too.

    `configs` are the tile limits whose grids are tried (default: base's alone;
    `candidate_configs(base)` adds bigger tiles and K splits for long K); `grids`, if
    given, are the only grids tried.

    Without `byte_cost_s` the plan that finishes first is chosen. With it, the plan that
    costs the coordinator's CPU least among those that finish within `cpu_slack` times
    the first: the coordinator's CPU is shared by every GEMM in flight, and a pool can
    step no faster than it hands steps out, while the makespan counts it only where it
    delays this GEMM (and the links' estimates carry the rest of that CPU). Its CPU is
    `byte_cost_s` a byte the placement moves (operands sent, results back), the tiles it
    keeps, and what `later` says the grid costs the GEMMs after this one (seconds, for
    the bytes it makes them move).

    `local_flops_per_s` 0 means the coordinator computes no GEMM of its own (local takes
    forever), unless no worker can.

    Local wins ties: it moves no bytes. GEMMs below base.min_offload_flops stay local,
    as in plan_gemm. A grid whose tiles fit no device is skipped.
    """
    if local_flops_per_s < 0 or (share_local and local_flops_per_s == 0):
        raise ValueError("local_flops_per_s must be >= 0, and > 0 to share")
    # Times are seconds from now; `ready_at` says when a device (LOCAL: the coordinator)
    # is done with work it already has.
    local_ready = (ready_at or {}).get(LOCAL, 0.0)
    local = local_ready + shape.flops / local_flops_per_s if local_flops_per_s else math.inf
    everyone = list(devices)
    if share_local:
        everyone.insert(0, DeviceEstimate(LOCAL, local_flops_per_s, math.inf, math.inf))
    bound = lower_bound(shape.flops, everyone) if devices else local
    best = PoolPlan(None, (), local, bound, local)
    if not devices:
        return best
    if grids is None:
        grids = candidate_plans(
            shape, devices, base, tiles_per_device=tiles_per_device, configs=configs
        )
    fastest_s = best.makespan
    # Each plan that was placed, with its CPU seconds at the coordinator.
    here_s = shape.flops / local_flops_per_s if local_flops_per_s else 0.0
    found: list[tuple[PoolPlan, float]] = [(best, here_s)]
    for plan in grids:
        placed = place_tiles(
            shape,
            plan.tiles,
            everyone,
            ready_at=ready_at,
            held=held,
            links=links,
            rule=rule,
            beat=fastest_s * cpu_slack if byte_cost_s else fastest_s,
        )
        if placed is None:  # some tile fits no device, or it cannot beat the best so far
            continue
        makespan = max(p.finish for p in placed)
        fastest_s = min(fastest_s, makespan)
        chosen = PoolPlan(plan, placed, makespan, bound, local)
        found.append((chosen, _coordinator_cpu_s(chosen, local_flops_per_s, byte_cost_s, later)))
    if not byte_cost_s:  # the fastest; ties to local, then to fewer tiles, then the first
        return min(
            found, key=lambda f: (f[0].makespan, f[0].plan is not None, len(f[0].placements))
        )[0]
    near = [f for f in found if f[0].makespan <= fastest_s * cpu_slack]
    return min(near, key=lambda f: (f[1], f[0].makespan, len(f[0].placements)))[0]


def _coordinator_cpu_s(
    chosen: PoolPlan,
    local_flops_per_s: float,
    byte_cost_s: float,
    later: Callable[[GemmPlan], float] | None,
) -> float:
    """What a plan costs the coordinator's CPU: the tiles it computes itself, the bytes
    its placements move (operands sent, results back), and what `later` says its grid
    costs the GEMMs after it."""
    assert chosen.plan is not None
    shape = chosen.plan.shape
    cpu = later(chosen.plan) if later is not None else 0.0
    for p in chosen.placements:
        if p.worker_id == LOCAL:
            cpu += p.tile.flops / local_flops_per_s
        else:
            cpu += (p.down_bytes + p.tile.up_bytes(shape.itemsize)) * byte_cost_s
    return cpu


def fastest(
    shape: GemmShape, devices: Sequence[DeviceEstimate], config: PlanConfig, count: int
) -> list[DeviceEstimate]:
    """The `count` devices that would finish the largest of plan_gemm's tiles of this GEMM
    first (ties: the order given). A device whose cap is below that tile comes last."""
    plan = plan_gemm(shape, config)
    if plan is None:
        return list(devices[:count])
    tile = plan.tiles[0]
    size = tile.total_bytes(shape.itemsize)
    # Read once, not once a device: a tile's sizes are worked out from its bounds.
    flops, down, up = tile.flops, tile.down_bytes(shape.itemsize), tile.up_bytes(shape.itemsize)

    def seconds(d: DeviceEstimate) -> float:
        if not d.can_hold(size):
            return math.inf
        return d.tile_seconds(flops, down, up)

    return heapq.nsmallest(count, devices, key=seconds)  # sorted(...)[:count], ties alike
