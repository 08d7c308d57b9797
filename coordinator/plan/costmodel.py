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
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from common.messages import DeviceProfile
from coordinator.plan.planner import GemmPlan, GemmShape, PlanConfig, TileRegion, plan_gemm

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
    link_samples: int = 0  # tiles whose transfer time was measured: 0 = links guessed

    def __post_init__(self) -> None:
        if min(self.flops_per_s, self.down_bps, self.up_bps) <= 0:
            raise ValueError(f"{self.worker_id}: speeds must be > 0")

    def tile_seconds(self, flops: int, down_bytes: int, up_bytes: int) -> float:
        return down_bytes / self.down_bps + flops / self.flops_per_s + up_bytes / self.up_bps

    def pipelined_seconds(self, flops: int, down_bytes: int, up_bytes: int) -> float:
        """What a tile adds to a busy worker's queue when its transfers overlap the
        compute of the tiles around it (a prefetch window of 2 or more): its slowest
        phase."""
        return max(down_bytes / self.down_bps, flops / self.flops_per_s, up_bytes / self.up_bps)

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

    measured = obs.down_s is not None and obs.down_s > 0 and obs.down_bytes > 0

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
        link_samples=estimate.link_samples + measured,
    )


def for_planning(estimate: DeviceEstimate, optimistic_bps: float) -> DeviceEstimate:
    """The estimate a planner should use. Links nobody has measured yet are assumed fast:
    a planner that believed the cautious guess would keep every tile at the coordinator,
    no tile would ever cross the link, and the guess would never be corrected. One slow
    first tile (which the speculative copies cover) is the price of finding out."""
    if estimate.link_samples:
        return estimate
    return dataclasses.replace(
        estimate,
        down_bps=max(estimate.down_bps, optimistic_bps),
        up_bps=max(estimate.up_bps, optimistic_bps),
    )


def queued_start(sent_at: float, last_result_at: float) -> float:
    """When a held tile's round trip effectively began, for overdue_finish: its send
    time, or the worker's last result if that came later. A worker computes one tile at
    a time, so a tile sent while another was computing waited until that one was back;
    counting from its send time would call it nearly done when it has barely begun."""
    return max(sent_at, last_result_at)


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
class LinkModel:
    """How a worker's transfers overlap its compute, and the coordinator's own uplink.

    `window` is how many tiles a worker may hold at once (the scheduler's prefetch
    window): with 1, download, compute and upload run in a row; with 2 (the server's
    default), the next tile downloads while this one computes, so a busy worker's tile
    costs the slowest of its three phases, not their sum. Every download also passes the
    coordinator's uplink, `egress_bps`, modelled as a shared pipe: the downloads placed
    so far cannot all have ended before it carried their bytes.
    """

    window: int = 1
    egress_bps: float = math.inf
    # The coordinator's own work per tile sent (cut, sign, frame, check the result), one
    # tile at a time: what makes many small tiles slower than a few big ones.
    tile_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.window < 1 or self.egress_bps <= 0 or self.tile_overhead_s < 0:
            raise ValueError("window must be >= 1, egress_bps > 0, tile_overhead_s >= 0")


SEQUENTIAL = LinkModel()
# The coordinator itself, when it computes a share of a GEMM: no link to cross.
LOCAL = "coordinator"


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
    bi, mi, ni, ki = tile.index
    b, m, n, k = tile.dims
    return (
        (("A", bi, mi, ki), shape.itemsize * b * m * k),
        (("B", bi, ni, ki), shape.itemsize * b * k * n),
    )


def _attempt(
    lane: _Lane,
    tile: TileRegion,
    blocks: tuple[tuple[Block, int], ...],
    up: int,
    links: LinkModel,
    floor: float,
) -> tuple[tuple[float, float, float, float], int]:
    """The lane's timeline for the tile, and the operand bytes it would be sent."""
    if lane.device.worker_id == LOCAL:  # the coordinator: no link to cross
        return lane.run(tile.flops, 0, up, links.window, 0.0), 0
    down = sum(nbytes for block, nbytes in blocks if block not in lane.held)
    return lane.run(tile.flops, down, up, links.window, floor + down / links.egress_bps), down


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

    def run(
        self, flops: int, down: int, up: int, window: int, egress_floor: float
    ) -> tuple[float, float, float, float]:
        """(start, download end, compute end, finish) of this device's next tile; the
        download cannot end before `egress_floor`, when the coordinator's uplink has had
        time to carry every byte sent so far plus this tile's."""
        d = self.device
        start = self.slot(window)
        down_end = max(start + down / d.down_bps, egress_floor)
        comp_end = max(down_end, self.comp_free) + flops / d.flops_per_s
        finish = max(comp_end, self.up_free) + up / d.up_bps
        return start, down_end, comp_end, finish


def place_tiles(
    shape: GemmShape,
    tiles: Sequence[TileRegion],
    devices: Sequence[DeviceEstimate],
    *,
    ready_at: Mapping[str, float] | None = None,
    held: Mapping[str, frozenset[Block]] | None = None,
    links: LinkModel = SEQUENTIAL,
    rule: str = "finish",
) -> tuple[Placement, ...] | None:
    """Place tiles on devices one at a time. None when some tile fits no device's cap.

    rule "finish" (the planner): largest tile first, each to the device that finishes it
    earliest (list scheduling). A device that already holds one of the tile's operand
    blocks (sent for an earlier tile, or in `held`) is not sent it again, so it tends to
    win and keep a row or column of the grid; ties go to the device holding more of the
    operands, then to the earlier device in `devices`.

    rule "pull" (what the server's scheduler does): tiles in grid order, each to the
    device with the earliest free slot, however slow it is; a device with no link (the
    coordinator, LOCAL) takes a tile instead when it would finish it no later.
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
    remote = 0  # tiles sent to workers so far
    # Pull: workers by their next free slot, so each tile costs log(devices), not devices.
    # The coordinator (no link) pulls nothing: it keeps a tile when it would finish it
    # before the worker that would pull it.
    here = [i for i, lane in enumerate(lanes) if lane.device.worker_id == LOCAL]
    slots = [(lane.slot(links.window), i) for i, lane in enumerate(lanes) if i not in here]
    heapq.heapify(slots)
    placements: list[Placement] = []
    for tile in order:
        blocks = operand_blocks(shape, tile)
        up = tile.up_bytes(shape.itemsize)
        size = tile.total_bytes(shape.itemsize)

        # A download cannot end before the coordinator's uplink carried it and the bytes
        # placed before it, and spent its per-tile work on it and on the tiles before.
        floor = t0 + sent / links.egress_bps + (remote + 1) * links.tile_overhead_s

        chosen: int | None = None
        if rule == "pull":
            skipped = []
            while slots and not lanes[slots[0][1]].device.can_hold(size):
                skipped.append(heapq.heappop(slots))
            if slots:
                chosen = slots[0][1]
                best_run, best_down = _attempt(lanes[chosen], tile, blocks, up, links, floor)
            for i in here:
                run, _ = _attempt(lanes[i], tile, blocks, up, links, floor)
                if chosen is None or run[3] <= best_run[3]:
                    chosen, best_run, best_down = i, run, 0
            if chosen is not None and chosen not in here:
                heapq.heappop(slots)
            for entry in skipped:
                heapq.heappush(slots, entry)
        else:
            best: tuple[float, ...] | None = None
            for i, lane in enumerate(lanes):
                if not lane.device.can_hold(size):
                    continue
                run, down = _attempt(lane, tile, blocks, up, links, floor)
                key = (run[3], -sum(b in lane.held for b, _ in blocks), i)
                if best is None or key < best:
                    best, best_run, best_down, chosen = key, run, down, i
        if chosen is None:
            return None
        lane = lanes[chosen]
        start, lane.down_free, lane.comp_free, finish = best_run
        sent += best_down
        remote += lane.device.worker_id != LOCAL
        lane.up_free = finish
        lane.finishes.append(finish)
        lane.held.update(block for block, _ in blocks)
        if rule == "pull" and chosen not in here:
            heapq.heappush(slots, (lane.slot(links.window), chosen))
        placements.append(Placement(tile, lane.device.worker_id, start, finish, best_down))
    return tuple(placements)


def candidate_configs(base: PlanConfig) -> list[PlanConfig]:
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
    return list(dict.fromkeys(configs))


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
    caps = [d.mem_cap_bytes for d in devices]
    plans: dict[tuple[int, int, int, int], GemmPlan] = {}
    for config in configs or [base]:
        cap = config.tile_mem_cap_bytes
        if caps and None not in caps:
            cap = min(cap, max(c for c in caps if c is not None))
        target = 1
        while target <= max(1, tiles_per_device * len(devices)):
            grown = dataclasses.replace(config, target_tiles=target, tile_mem_cap_bytes=cap)
            try:
                plan = plan_gemm(shape, grown)
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
    links: LinkModel = SEQUENTIAL,
    share_local: bool = False,
    tiles_per_device: int = 4,
    configs: Sequence[PlanConfig] | None = None,
    rule: str = "finish",
    grids: Sequence[GemmPlan] | None = None,
) -> PoolPlan:
    """Offload vs local and the tile grid with the smallest estimated makespan.

    With `share_local` the coordinator is one more device in the placement (worker id
    LOCAL, no link to cross), so a plan may keep some tiles here and send the rest: on a
    pool whose links cannot carry a whole GEMM's operands in time, the coordinator does
    what the links cannot feed. Its speed then counts in the lower bound too.

    `configs` are the tile limits whose grids are tried (default: base's alone;
    `candidate_configs(base)` adds bigger tiles and K splits for long K); `grids`, if
    given, are the only grids tried.

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
    for plan in grids:
        placed = place_tiles(
            shape, plan.tiles, everyone, ready_at=ready_at, held=held, links=links, rule=rule
        )
        if placed is None:
            continue
        makespan = max(p.finish for p in placed)
        better = makespan < best.makespan or (
            makespan == best.makespan
            and best.plan is not None
            and len(placed) < len(best.placements)
        )
        if better:
            best = PoolPlan(plan, placed, makespan, bound, local)
    return best


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

    def seconds(d: DeviceEstimate) -> float:
        if not d.can_hold(size):
            return math.inf
        return d.tile_seconds(
            tile.flops, tile.down_bytes(shape.itemsize), tile.up_bytes(shape.itemsize)
        )

    return sorted(devices, key=seconds)[:count]


class Commitments:
    """When the plans made so far expect each worker to be done with its tiles, so that a
    GEMM planned while others are in flight is planned after them (independent GEMMs
    of a step are handed out together). Times are the caller's clock."""

    def __init__(self) -> None:
        self._free: dict[str, float] = {}

    def ready_at(self, now: float, worker_ids: Iterable[str]) -> dict[str, float]:
        """Seconds from `now` until each worker is free of planned work."""
        return {w: max(0.0, self._free.get(w, now) - now) for w in worker_ids}

    def add(self, now: float, chosen: PoolPlan) -> None:
        for p in chosen.placements:
            if p.worker_id != LOCAL:
                self._free[p.worker_id] = max(self._free.get(p.worker_id, now), now + p.finish)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop workers that left (the caller passes those still there)."""
        alive = set(keep)
        self._free = {w: t for w, t in self._free.items() if w in alive}


@dataclass(frozen=True)
class LiveChoice:
    """What LivePlanning decided for one GEMM."""

    plan: GemmPlan | None  # None: the coordinator computes the whole GEMM
    local: frozenset[tuple[int, int, int, int]] = frozenset()  # tiles kept here
    # The worker each remote tile was placed on (TileTicket.planned_for); empty when the
    # grid planner decided (no cost model, no estimates): tiles go to whoever is free.
    owners: Mapping[tuple[int, int, int, int], str] = dataclasses.field(default_factory=dict)

    @property
    def all_here(self) -> bool:
        return self.plan is None or len(self.local) == len(self.plan.tiles)


@dataclass(frozen=True)
class LivePlanning:
    """How live GEMMs are planned (coordinator/serve/offload.py; the simulator's cost-model
    planner runs the same code).

    With the cost model (the default), each GEMM gets the grid whose tiles, placed by
    earliest estimated finish on the workers as the server knows them, finish first; with
    `coordinator_flops_per_s` > 0 the coordinator is one more device and keeps the tiles
    it would finish first (the links cannot feed the pool everything). Without it, the
    grid is plan_gemm's for about two tiles per worker, as before the cost model.
    """

    cost_model: bool = True
    coordinator_flops_per_s: float = 0.0  # 0: the coordinator computes no tile itself
    window: int = 2  # a worker's prefetch window (the worker's default)
    # What one more tile costs beyond its bytes and FLOPs: signing, framing, two event-loop
    # hops, the signature check and the result check. Measured on the built-in job (2
    # cores, 2 local workers): 2 ms planned too many tiles (0.5-0.7 s/step, rising as the
    # estimates settled), 4 ms 0.42-0.45 s/step (grid planner: 0.53 s). A coordinator
    # alone handles ~640 tiles/s (bench/bench_load.py), ~1.6 ms each; erring high costs a
    # little balance, erring low floods the coordinator with crumbs.
    tile_overhead_s: float = 4e-3
    egress_bps: float = math.inf  # the coordinator's uplink, if known
    # Links a worker has not shown yet are planned as 10 Gbit/s (costmodel.for_planning).
    optimistic_link_bps: float = 1.25e9
    # Placing costs tiles x log(workers) per grid (pull; tiles x workers by earliest
    # finish): in a bigger pool the plan is made for the workers that would finish one of
    # plan_gemm's tiles first (all of them still pull tiles; copies cover the tail).
    max_workers: int = 256
    tiles_per_device: int = 4
    # How the plan is placed. "finish": each tile on the worker that would return it
    # first; the tickets name that worker (TileTicket.planned_for) and the scheduler hands
    # the tile to it, or to one that would return it clearly sooner (a steal). "pull":
    # placed as plain pull hands tiles out (each to the first free slot, however slow),
    # and the tickets name nobody. "auto": "finish" where compute binds (the plan is
    # within `follow_within` of total work / total speed, so the cost model has little
    # to get wrong), "pull" where links bind: there the plans mispredict transfers, and
    # in the simulator binding them all made steps slower (opt-125m, 64 campus devices:
    # 4.9 s vs 3.8 s per step), while in compute-bound pools of 16-64 devices following
    # them took GEMMs from 1.8-85x of the bound to 1.01-1.12x (simulation table d)...
    rule: str = "auto"
    follow_within: float = 1.5
    # ...or where the plan promises to beat pull by this factor even so: a gain that big
    # survives the mispredicted transfers (simulation table d: 64 GPUs and CPUs on a
    # 10 Gbit/s LAN, 13x of the bound followed vs 81x pulled).
    follow_gain: float = 2.0
    # Placing by earliest finish costs tiles x workers per grid: ~0.07 s per GEMM at 64
    # workers in Python (the simulator, opt-125m), too much for the training thread
    # beyond that. Larger pools are pulled (their copies cover the tail).
    follow_max_workers: int = 64

    def plan(
        self,
        shape: GemmShape,
        estimates: Sequence[DeviceEstimate],
        config: PlanConfig,
        commitments: Commitments | None = None,
        *,
        now: float = 0.0,
        coordinator_busy_s: float = 0.0,
    ) -> LiveChoice:
        """The grid for one GEMM, the tiles kept at the coordinator and the worker each
        other tile is planned for, planned after the work `commitments` hold (and the
        coordinator's `coordinator_busy_s`), which then hold this plan's too. Raises
        ValueError (from plan_gemm) when not even a one-element tile fits the grid
        planner's limits."""
        ready = None
        if commitments is not None:
            ready = commitments.ready_at(now, [e.worker_id for e in estimates])
            ready[LOCAL] = coordinator_busy_s
        if self.rule == "auto":
            chosen, follow = self._auto(shape, estimates, config, ready)
        else:
            chosen, follow = self.pool_plan(shape, estimates, config, ready), self.rule == "finish"
        if chosen is None:
            return LiveChoice(plan_gemm(shape, config))
        if commitments is not None:
            commitments.add(now, chosen)
        return LiveChoice(
            chosen.plan,
            frozenset(t.index for t in chosen.local_tiles),
            {p.tile.index: p.worker_id for p in chosen.placements if p.worker_id != LOCAL}
            if follow
            else {},
        )

    def _auto(
        self,
        shape: GemmShape,
        estimates: Sequence[DeviceEstimate],
        config: PlanConfig,
        ready: Mapping[str, float] | None,
    ) -> tuple[PoolPlan | None, bool]:
        """The "auto" rule: the grid whose tiles, as pull would hand them out, finish
        first; then that grid or the finest one (up to `tiles_per_device` per worker)
        placed by earliest finish, to be followed where that is worth it: every
        worker's links measured (a plan that binds tiles to workers only the optimistic
        guess made fast could hold a GEMM behind a slow link), at most
        `follow_max_workers` of them, and compute binding (within `follow_within` of the
        bound) or a gain over pull of `follow_gain`. Placing by earliest finish costs
        tiles x workers, so it is done for two grids, not for every candidate."""
        pulled = self.pool_plan(shape, estimates, config, ready, rule="pull")
        if pulled is None or pulled.plan is None:
            return pulled, False
        if len(estimates) > self.follow_max_workers or any(not e.link_samples for e in estimates):
            return pulled, False
        # Pull's grid, and the finest grid (earliest finish balances many small tiles).
        grids = candidate_plans(shape, estimates, config)
        finest = max(grids, key=lambda g: len(g.tiles), default=pulled.plan)
        finish = self.pool_plan(
            shape, estimates, config, ready, rule="finish", grids=[pulled.plan, finest]
        )
        if finish is None or finish.plan is None:  # placed so, the coordinator would win
            return pulled, False
        waited = min((ready or {}).values(), default=0.0)  # earlier plans' work, not this
        own, pull_own = finish.makespan - waited, pulled.makespan - waited
        if own <= self.follow_within * finish.lower_bound or pull_own > self.follow_gain * own:
            return finish, True
        return pulled, False

    def pool_plan(
        self,
        shape: GemmShape,
        estimates: Sequence[DeviceEstimate],
        config: PlanConfig,
        ready_at: Mapping[str, float] | None = None,
        *,
        rule: str | None = None,
        grids: Sequence[GemmPlan] | None = None,
    ) -> PoolPlan | None:
        """The cost model's whole plan (placements included; `rule`: place_tiles', by
        default this planning's, "finish" for "auto"), or None where the grid planner
        decides (no cost model, or no estimates yet)."""
        if not self.cost_model or not estimates:
            return None
        rule = rule or self.rule
        devices = [for_planning(e, self.optimistic_link_bps) for e in estimates]
        if len(devices) > self.max_workers:
            devices = fastest(shape, devices, config, self.max_workers)
        share = self.coordinator_flops_per_s > 0
        return plan_for_pool(
            shape,
            devices,
            local_flops_per_s=self.coordinator_flops_per_s,
            base=config,
            links=LinkModel(self.window, self.egress_bps, self.tile_overhead_s),
            ready_at=ready_at,
            share_local=share,
            tiles_per_device=self.tiles_per_device,
            configs=candidate_configs(config),
            rule="finish" if rule == "auto" else rule,
            grids=grids,
        )
