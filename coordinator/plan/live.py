"""How the server plans its GEMMs as they come: the cost model's plan for each, after the
work earlier plans committed, and whether its placement is followed or pulled.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from coordinator.plan.estimates import DeviceEstimate, LinkModel, for_planning
from coordinator.plan.layouts import Layouts, Operand
from coordinator.plan.placement import (
    LOCAL,
    Block,
    PoolPlan,
    candidate_configs,
    candidate_plans,
    fastest,
    plan_for_pool,
    plans_on_grids,
)
from coordinator.plan.planner import GemmPlan, GemmShape, PlanConfig, plan_gemm


class Planner(str, enum.Enum):
    """How GEMMs are cut: the names ``serve --planner``, the simulator and the benches use."""

    COST = "cost"  # the cost model of the workers as measured (LivePlanning, the default)
    GRID = "grid"  # plan_gemm's grid for about two tiles per worker, the cost model unused


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
class _Aligned:
    """What `Layouts` adds to a GEMM's planning: the grids to try (None: the usual
    candidates) and the blocks each worker holds."""

    grids: list[GemmPlan] | None = None
    held: Mapping[str, frozenset[Block]] = dataclasses.field(default_factory=dict)
    later: Callable[[GemmPlan], float] | None = None  # plan_for_pool's


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
    # hops, the signature check and the result check (bench/bench_load.py measures the
    # coordinator's share). Erring high costs a little balance; erring low floods the
    # coordinator with crumbs.
    tile_overhead_s: float = 4e-3
    # ...and per byte a tile moves, operands out and result back (the server plans with
    # keep_home.CPU_S_PER_BYTE): where it binds, a grid that sends a block to two
    # workers, or cuts more tiles than the workers need, finishes later.
    cpu_s_per_byte: float = 0.0
    # Where it is counted, the plan that costs the coordinator's CPU least is chosen from
    # those that finish within this factor of the fastest (placement.plan_for_pool): a
    # pool steps no faster than its coordinator hands steps out.
    cpu_slack: float = 1.25
    egress_bps: float = math.inf  # the coordinator's uplink, if known
    # Links a worker has not shown yet are planned as 10 Gbit/s (estimates.for_planning).
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
    # binding every tile to its planned worker makes steps slower, while in compute-bound
    # pools following them brings GEMMs close to the bound (docs/simulation.md, (d))...
    rule: str = "auto"
    follow_within: float = 1.5
    # ...or where the plan promises to beat pull by this factor even so: a gain that big
    # survives the mispredicted transfers (docs/simulation.md, (d)).
    follow_gain: float = 2.0
    # Placing by earliest finish costs tiles x workers per grid, in Python on the training
    # thread: past this many workers it costs more than it saves. Larger pools are pulled
    # (their copies cover the tail).
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
        layouts: Layouts | None = None,
        operands: tuple[Operand | None, Operand | None] = (None, None),
    ) -> LiveChoice:
        """The grid for one GEMM, the tiles kept at the coordinator and the worker each
        other tile is planned for, planned after the work `commitments` hold (and the
        coordinator's `coordinator_busy_s`), which then hold this plan's too; with
        `layouts` (and the GEMM's A and B as `operands`), the grids that cut its operands
        as earlier plans did are tried too, the blocks those placed counted as held, and
        this plan's cut and placements kept for later ones. Raises ValueError (from
        plan_gemm) when not even a one-element tile fits the grid planner's limits."""
        ready = None
        if commitments is not None:
            ready = commitments.ready_at(now, [e.worker_id for e in estimates])
            ready[LOCAL] = coordinator_busy_s
        aligned = _Aligned()
        if layouts is not None and self.cost_model and estimates:
            layouts.forget(e.worker_id for e in estimates)
            aligned = self._aligned(shape, estimates, config, layouts, operands)
        if self.rule == "auto":
            chosen, follow = self._auto(shape, estimates, config, ready, aligned)
        else:
            chosen = self.pool_plan(
                shape,
                estimates,
                config,
                ready,
                grids=aligned.grids,
                held=aligned.held,
                later=aligned.later,
            )
            follow = self.rule == "finish"
        if chosen is None:
            return LiveChoice(plan_gemm(shape, config))
        if commitments is not None:
            commitments.add(now, chosen)
        if layouts is not None and chosen.plan is not None:
            caps = {e.worker_id: e.mem_cap_bytes for e in estimates}
            layouts.record(shape, chosen.plan.grid, operands, chosen.placements, caps)
        return LiveChoice(
            chosen.plan,
            frozenset(t.index for t in chosen.local_tiles),
            {p.tile.index: p.worker_id for p in chosen.placements if p.worker_id != LOCAL}
            if follow
            else {},
        )

    def _devices(
        self, shape: GemmShape, estimates: Sequence[DeviceEstimate], config: PlanConfig
    ) -> list[DeviceEstimate]:
        """The devices a plan is made for: at most `max_workers`, the fastest."""
        devices = [for_planning(e, self.optimistic_link_bps) for e in estimates]
        if len(devices) > self.max_workers:
            devices = fastest(shape, devices, config, self.max_workers)
        return devices

    def _aligned(
        self,
        shape: GemmShape,
        estimates: Sequence[DeviceEstimate],
        config: PlanConfig,
        layouts: Layouts,
        operands: tuple[Operand | None, Operand | None],
    ) -> _Aligned:
        """The candidate grids with those that cut the operands as earlier plans did
        (None where no worker holds a block of them: then the usual candidates), the
        blocks each worker holds, and what a grid's cut of a matrix read for the first
        time costs its later read."""
        held = layouts.held(shape, operands)
        later = None
        if self.cpu_s_per_byte > 0:

            def later(plan: GemmPlan) -> float:
                return layouts.later_bytes(shape, operands, plan.grid) * self.cpu_s_per_byte

        if not held:  # no worker holds a block of them: nothing to align with
            return _Aligned(None, held, later)
        devices = self._devices(shape, estimates, config)
        configs = candidate_configs(config)
        candidates = candidate_plans(
            shape, devices, config, tiles_per_device=self.tiles_per_device, configs=configs
        )
        extra = layouts.variants(shape, operands, [p.grid for p in candidates])
        return _Aligned(candidates + plans_on_grids(shape, devices, extra, configs), held, later)

    def _auto(
        self,
        shape: GemmShape,
        estimates: Sequence[DeviceEstimate],
        config: PlanConfig,
        ready: Mapping[str, float] | None,
        aligned: _Aligned,
    ) -> tuple[PoolPlan | None, bool]:
        """The "auto" rule: the grid whose tiles, as pull would hand them out, finish
        first; then that grid or the finest one (up to `tiles_per_device` per worker)
        placed by earliest finish, to be followed where that is worth it: every
        worker's links measured (a plan that binds tiles to workers only the optimistic
        guess made fast could hold a GEMM behind a slow link), at most
        `follow_max_workers` of them, and compute binding (within `follow_within` of the
        bound) or a gain over pull of `follow_gain`. Placing by earliest finish costs
        tiles x workers, so it is done for two grids, not for every candidate."""
        held, later = aligned.held, aligned.later
        pulled = self.pool_plan(
            shape,
            estimates,
            config,
            ready,
            rule="pull",
            grids=aligned.grids,
            held=held,
            later=later,
        )
        if pulled is None or pulled.plan is None:
            return pulled, False
        if len(estimates) > self.follow_max_workers or any(not e.link_samples for e in estimates):
            return pulled, False
        # Pull's grid, and the finest grid (earliest finish balances many small tiles).
        grids = candidate_plans(shape, estimates, config)
        finest = max(grids, key=lambda g: len(g.tiles), default=pulled.plan)
        finish = self.pool_plan(
            shape,
            estimates,
            config,
            ready,
            rule="finish",
            grids=[pulled.plan, finest],
            held=held,
            later=later,
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
        held: Mapping[str, frozenset[Block]] | None = None,
        later: Callable[[GemmPlan], float] | None = None,
    ) -> PoolPlan | None:
        """The cost model's whole plan (placements included; `rule`: place_tiles', by
        default this planning's, "finish" for "auto"; `held`: the blocks each worker
        holds already), or None where the grid planner decides (no cost model, or no
        estimates yet)."""
        if not self.cost_model or not estimates:
            return None
        rule = rule or self.rule
        devices = self._devices(shape, estimates, config)
        share = self.coordinator_flops_per_s > 0
        return plan_for_pool(
            shape,
            devices,
            local_flops_per_s=self.coordinator_flops_per_s,
            base=config,
            links=LinkModel(
                self.window, self.egress_bps, self.tile_overhead_s, self.cpu_s_per_byte
            ),
            ready_at=ready_at,
            share_local=share,
            tiles_per_device=self.tiles_per_device,
            configs=candidate_configs(config),
            rule="finish" if rule == "auto" else rule,
            grids=grids,
            held=held,
            later=later,
            byte_cost_s=self.cpu_s_per_byte,
            cpu_slack=self.cpu_slack,
        )
