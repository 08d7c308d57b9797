"""The event loop: a simulated clock, simulated devices, and the live coordinator's core.

Each device runs the tiles it holds through three resources in order: its downlink (and
the coordinator's shared egress), its compute, its uplink. A prefetch window of 2 lets
the next tile's download overlap the current tile's compute, as real workers do. When a
tile is assigned its whole timeline is known, so one event (the result arriving) stands
for it; a cancel or a death takes the tile off and re-plans the tiles behind it.

The coordinator is the server's own ``CoordinatorCore``: joins, heartbeats, results and
the expiry tick go in as the server's pump feeds them, and its effects (task frames,
cancels, closes, checks, tiles to compute here) act on the simulated pool. Every
decision (assignment, the finish predictions, speculation, the operand-cache mirror,
what it learns of each device, the pool view the planner reads) is therefore the
server's, not a copy. Stages are planned as the live offload plans them, from the
core's pool view. Results are always correct here; the check costs nothing.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.messages import Cancel, DeviceProfile, Heartbeat, Hello, Result
from common.signing import generate_private_key
from coordinator.plan.estimates import DeviceEstimate
from coordinator.plan.live import Commitments, LiveChoice, LivePlanning, Planner
from coordinator.plan.planner import GemmPlan, GemmShape, PlanConfig, plan_config_for, plan_gemm
from coordinator.pool.core import CoordinatorCore, CoreConfig
from coordinator.pool.effects import Checked, Effects
from coordinator.pool.ledger import Ledger
from coordinator.schedule.scheduler import Scheduler, SchedulerConfig, TileTicket
from coordinator.sim.config import SimConfig
from coordinator.sim.devices import DeviceState, Run, SimGemm, SimTile
from coordinator.sim.models import MODELS, Stage, step_flops, step_stages
from coordinator.sim.population import Device
from coordinator.tiles.verify import CheckResult


@dataclass
class _Step:
    index: int
    start: float
    stage: int = 0
    waiting_tiles: set[str] = field(default_factory=set)
    waiting_local: int = 0
    stage_start: float = 0.0


class Simulation:
    def __init__(
        self,
        config: SimConfig,
        devices: list[Device],
        *,
        stages: list[Stage] | None = None,
        known_pool: bool = False,
    ) -> None:
        """`stages` replaces the model's step (each stage's GEMMs are independent, the
        stages run in order); with `known_pool` the coordinator starts out knowing every
        device's true speed and links, as if it had learnt them."""
        self.config = config
        self.core = CoordinatorCore(
            key=generate_private_key(),
            ledger=Ledger(Path(":memory:")),
            config=CoreConfig(
                heartbeat_interval_s=config.heartbeat_interval_s,
                max_messages_per_s=0.0,  # the simulated workers are honest
                scheduler=SchedulerConfig(
                    heartbeat_timeout_s=config.heartbeat_timeout_s,
                    tile_timeout_s=config.tile_timeout_s,
                    speculate_after=config.speculate_after,
                    leave_for_faster=config.leave_for_faster,
                ),
            ),
        )
        if config.ranks > 1:
            if stages is not None:
                raise ValueError("ranks split a model's batch: give no stages of your own")
            devices = devices[:: config.ranks]  # rank 0's share
        self.stages = stages or step_stages(
            MODELS[config.model], config.batch // config.ranks, config.seq, config.itemsize
        )
        # The live offload's planner, told what a tile costs the coordinator (if modelled).
        self._planning = LivePlanning(
            coordinator_flops_per_s=config.coordinator_gflops * 1e9 * config.coordinator_share,
            window=config.window,
            tile_overhead_s=config.coordinator_cpu_per_tile_s,
            egress_bps=config.coordinator_egress_bps,
            rule=config.placement,
        )
        self._plan_config = plan_config_for(config.min_offload_flops / 1e6)
        self.devices = {d.device_id: DeviceState(d) for d in devices}
        self._known_pool = known_pool
        self.now = 0.0
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self._coord_link_free = 0.0
        self._coord_comp_free = 0.0
        self._coord_cpu_free = 0.0
        self.coordinator_cpu_s = 0.0  # what handing tiles out cost the coordinator's CPU
        self._commitments = Commitments()
        self._tiles: dict[str, SimTile] = {}
        self._step: _Step | None = None
        self.step_times: list[float] = []
        self.stage_times: list[float] = []  # each stage, from planning to its last result
        self.step_bounds: list[tuple[float, float]] = []
        self.local_flops = 0
        self.taken_over = 0
        self.lost_tiles: set[str] = set()  # tiles that went back to the queue at least once
        self.failures: list[tuple[str, float, str]] = []
        self.gave_up = False

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    # --- events -------------------------------------------------------------------------

    def _push(self, at: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, kind, payload))

    def run(self) -> dict[str, Any]:
        for state in self.devices.values():
            d = state.device
            self._push(d.join_at, "join", d.device_id)
            if d.leave_at < math.inf:
                self._push(d.leave_at, "leave", d.device_id)
            if d.fail_at < math.inf:
                self._push(d.fail_at, "fail", d.device_id)
        self._push(0.0, "step", 0)
        self._push(self.config.heartbeat_interval_s, "tick", None)
        while self._events and len(self.step_times) < self.config.steps:
            at, _, kind, payload = heapq.heappop(self._events)
            if at > self.config.max_sim_s:
                self.gave_up = True
                break
            self.now = at
            getattr(self, "_on_" + kind)(payload)
        return self.result()

    def _on_join(self, device_id: str) -> None:
        state = self.devices[device_id]
        if not state.alive or state.device.leave_at <= self.now:
            return
        d = state.device
        state.registered = True
        state.down_free = state.comp_free = state.up_free = self.now
        hello = Hello(
            name=device_id,
            profile=DeviceProfile(
                mem_cap_bytes=d.mem_cap_bytes, gflops=d.claimed_flops / 1e9, threads=1
            ),
            window=self.config.window,
            worker_key=hashlib.sha256(device_id.encode()).hexdigest(),
            cache_bytes=d.mem_cap_bytes if self.config.operand_cache else 0,
        )
        effects = self.core.admit(device_id, hello, self.now)
        if self._known_pool:
            self.core.set_estimate(
                device_id,
                DeviceEstimate(
                    device_id, d.true_flops, d.down_bps, d.up_bps, d.mem_cap_bytes, self.now, 1
                ),
            )
        self._apply(effects)

    def _on_leave(self, device_id: str) -> None:
        state = self.devices[device_id]
        if not state.alive:
            return
        self.failures.append((device_id, self.now, "leave"))
        self._kill(state)
        self.lost_tiles.update(self.scheduler.in_flight(device_id))
        state.registered = False
        self._apply(self.core.disconnected(device_id, self.now))

    def _on_fail(self, device_id: str) -> None:
        state = self.devices[device_id]
        if state.alive:
            self.failures.append((device_id, self.now, "fail"))
            self._kill(state)  # stays registered until its heartbeats are missed

    def _kill(self, state: DeviceState) -> None:
        state.alive = False
        for run in state.runs.values():
            state.wasted_flops += run.computed_part(self.now)
        state.runs.clear()

    def _on_tick(self, _: None) -> None:
        silent: dict[str, frozenset[str]] = {}  # what each silently dead device holds
        for device_id, state in self.devices.items():
            if state.registered:
                if state.alive:
                    beat = Heartbeat(0, "working", len(state.runs))
                    self._apply(self.core.handle(device_id, beat, self.now))
                else:
                    silent[device_id] = self.scheduler.in_flight(device_id)
        effects = self.core.tick(self.now)
        for close in effects.closes:  # expired: what it held goes back to the queue
            self.lost_tiles.update(silent.get(close.worker_id, ()))
        self._apply(effects)
        self.core.ledger.flush()  # as the server does after each turn of its loop
        self._push(self.now + self.config.heartbeat_interval_s, "tick", None)

    def _on_result(self, key: tuple[str, str, int]) -> None:
        device_id, tile_id, token = key
        state = self.devices[device_id]
        run = state.runs.get(tile_id)
        if run is None or run.token != token or not state.alive:
            return
        del state.runs[tile_id]
        state.up_bytes += run.ticket.up_bytes
        verified = self.core.counters.tiles_verified
        result = Result(tile_id, compute_s=run.comp_end - run.comp_start)
        self._apply(self.core.handle(device_id, result, self.now))
        if self.core.counters.tiles_verified > verified:
            state.useful_flops += run.ticket.flops
        else:  # a copy that lost, or a tile taken back meanwhile
            state.wasted_flops += run.ticket.flops

    def _on_local(self, tile_id: str | None) -> None:
        step = self._step
        if step is None:
            return
        if tile_id is None:
            step.waiting_local -= 1
        else:
            tile = self._tiles.get(tile_id)
            if self._place(tile_id):  # the GEMM is whole: stragglers' copies go
                self._apply(self.core.delivered(tile, True, self.now))
            self._tile_done(tile_id)
        self._maybe_next_stage()

    def _on_step(self, index: int) -> None:
        self._step = _Step(index, self.now)
        self._submit_stage()

    # --- the coordinator: CoordinatorCore's effects on the simulated pool ------------------

    def _apply(self, effects: Effects) -> None:
        for send in effects.sends:
            state = self.devices[send.worker_id]
            if send.tile_id:
                self._start_run(state, send.tile_id, len(send.frame))
            elif isinstance(send.message, Cancel):
                self._cancel(state, send.message.tile_id)
        for close in effects.closes:  # missed heartbeats: the connection is gone
            self.devices[close.worker_id].registered = False
        for check in effects.checks:  # every simulated result is correct, and placed
            finished = self._place(check.tile_id)
            self._apply(self.core.checked(check, Checked(_CORRECT, finished), self.now))
            self._tile_done(check.tile_id)
        for tile in effects.compute_here:
            self.taken_over += 1
            self._run_locally(tile.flops, tile.tile_id)

    def _place(self, tile_id: str) -> bool:
        """A tile is in its GEMM: True when that made the GEMM whole."""
        tile = self._tiles.pop(tile_id, None)
        if tile is None:
            return False
        tile.gemm.remaining -= 1
        return tile.gemm.remaining == 0

    def _tile_done(self, tile_id: str) -> None:
        step = self._step
        if step is not None and tile_id in step.waiting_tiles:
            step.waiting_tiles.discard(tile_id)
            self._maybe_next_stage()

    def _maybe_next_stage(self) -> None:
        step = self._step
        if step is None or step.waiting_tiles or step.waiting_local > 0:
            return
        self.stage_times.append(self.now - step.stage_start)
        step.stage += 1
        if step.stage < len(self.stages):
            self._submit_stage()
            return
        end = self.now + self.config.allreduce_s
        self.step_times.append(end - step.start)
        self.step_bounds.append((step.start, end))
        self._step = None
        self._push(end, "step", step.index + 1)

    def _submit_stage(self) -> None:
        step = self._step
        assert step is not None
        step.stage_start = self.now
        tiles: list[SimTile] = []
        for name, shape in self.stages[step.stage]:
            gemm_id = f"s{step.index}.{name}"
            choice = self._plan(shape)
            if choice.plan is None or choice.all_here:
                step.waiting_local += 1
                self._run_locally(shape.flops, None)
                continue
            gemm = SimGemm(gemm_id)
            owners = choice.owners if self.config.follow_plan else {}
            for region in choice.plan.tiles:
                if region.index in choice.local:  # the coordinator's share
                    step.waiting_local += 1
                    self._run_locally(region.flops, None)
                    continue
                tile_id = f"{gemm_id}.{'.'.join(map(str, region.index))}"
                bi, mi, ni, ki = region.index
                b, m, n, k = region.dims
                blocks = (f"{gemm_id}/a/{bi}.{mi}.{ki}", f"{gemm_id}/b/{bi}.{ki}.{ni}")
                ticket = TileTicket(
                    tile_id,
                    gemm_id,
                    region.flops,
                    region.down_bytes(shape.itemsize),
                    region.up_bytes(shape.itemsize),
                    blocks=blocks,
                    planned_for=owners.get(region.index),
                )
                sizes = (shape.itemsize * b * m * k, shape.itemsize * b * k * n)
                tile = SimTile(tile_id, ticket, blocks, sizes, shape.itemsize, gemm)
                gemm.remaining += 1
                self._tiles[tile_id] = tile
                step.waiting_tiles.add(tile_id)
                tiles.append(tile)
        self._apply(self.core.submit(tiles, self.now))
        if not tiles:
            self._maybe_next_stage()

    def _plan(self, shape: GemmShape) -> LiveChoice:
        """The grid and the tiles the coordinator keeps, as the live offload plans them
        from the core's view of the pool."""
        pool = self.core.pool
        config = self._plan_config(pool.active, pool.memory_cap)
        if self.config.planner is Planner.COST and pool.estimates:
            # Work already planned (earlier GEMMs of this stage, the coordinator's share
            # of them) is still to do: plan this GEMM after it, as the live offload does.
            try:
                return self._planning.plan(
                    shape,
                    pool.estimates,
                    config,
                    self._commitments,
                    now=self.now,
                    coordinator_busy_s=max(0.0, self._coord_comp_free - self.now),
                )
            except ValueError:  # no tile fits any device: the coordinator computes it
                return LiveChoice(None)
        return LiveChoice(_cached_plan(shape, config))

    def _run_locally(self, flops: int, tile_id: str | None) -> None:
        start = max(self.now, self._coord_comp_free)
        self._coord_comp_free = start + flops / (self.config.coordinator_gflops * 1e9)
        self.local_flops += flops
        self._push(self._coord_comp_free, "local", tile_id)

    def _cancel(self, state: DeviceState, tile_id: str) -> None:
        run = state.runs.pop(tile_id, None)
        if run is not None:
            state.wasted_flops += run.computed_part(self.now)
            self._push_results(state)

    # --- device side --------------------------------------------------------------------

    def _start_run(self, state: DeviceState, tile_id: str, nbytes: int) -> None:
        ticket = self._tiles[tile_id].ticket
        state.saved_bytes += ticket.down_bytes - nbytes
        config = self.config
        cpu = config.coordinator_cpu_per_tile_s
        cpu += (nbytes + ticket.up_bytes) * config.coordinator_cpu_per_byte_s
        self._coord_cpu_free = max(self.now, self._coord_cpu_free) + cpu
        self.coordinator_cpu_s += cpu
        start = max(self._coord_cpu_free, state.down_free)
        link_start = max(start, self._coord_link_free)
        self._coord_link_free = link_start + nbytes / self.config.coordinator_egress_bps
        down_end = max(start + nbytes / state.device.down_bps, self._coord_link_free)
        state.down_free = down_end
        state.down_bytes += nbytes
        if not state.alive:
            return  # a silently dead worker was handed a tile: the bytes are gone
        state.runs[tile_id] = Run(
            ticket, self.now, start, down_end, comp_start=math.inf, down_bytes=nbytes
        )
        self._push_results(state)

    def _push_results(self, state: DeviceState) -> None:
        for at, tile_id, token in state.replan(self.now):
            self._push(at, "result", (state.device.device_id, tile_id, token))

    # --- results ------------------------------------------------------------------------

    def result(self) -> dict[str, Any]:
        flops_per_step = step_flops(self.stages)
        stats = self.scheduler.stats
        devices = []
        pool_flops_s = 0.0
        for state in self.devices.values():
            d = state.device
            live_s = sum(
                max(0.0, min(end, d.leave_at, d.fail_at) - max(start, d.join_at))
                for start, end in self.step_bounds
            )
            pool_flops_s += live_s * d.true_flops
            devices.append(
                {
                    "id": d.device_id,
                    "gflops": round(d.true_flops / 1e9, 3),
                    "claimed_gflops": round(d.claimed_flops / 1e9, 3),
                    "down_bytes": state.down_bytes,
                    "up_bytes": state.up_bytes,
                    "saved_bytes": state.saved_bytes,
                    "useful_gflop": round(state.useful_flops / 1e9, 3),
                    "wasted_gflop": round(state.wasted_flops / 1e9, 3),
                }
            )
        useful = sum(s.useful_flops for s in self.devices.values())
        return {
            "config": _config_json(self.config),
            "devices_total": len(self.devices),
            "coordinator_cpu_s": round(self.coordinator_cpu_s, 6),
            "allreduce_s": round(self.config.allreduce_s, 6),
            "steps_done": len(self.step_times),
            "gave_up": self.gave_up,
            "step_times_s": [round(t, 6) for t in self.step_times],
            "flops_per_step": flops_per_step,
            "utilisation": round(useful / pool_flops_s, 6) if pool_flops_s else 0.0,
            "down_bytes": sum(s.down_bytes for s in self.devices.values()),
            "up_bytes": sum(s.up_bytes for s in self.devices.values()),
            # Operand bytes the cache kept off the wire: down_bytes + saved_bytes is what
            # every tile carrying its operands would have cost.
            "saved_bytes": sum(s.saved_bytes for s in self.devices.values()),
            "tile_flops_done": useful,
            "local_flops": self.local_flops,
            "taken_over": self.taken_over,
            "lost_tiles": len(self.lost_tiles),
            "failures": [{"device": d, "at": round(t, 6), "kind": k} for d, t, k in self.failures],
            "scheduler": {
                "submitted": stats.submitted,
                "completed": stats.completed,
                "reissued": stats.reissued,
                "duplicates": stats.duplicates,
                "speculated": stats.speculated,
                "pending": self.scheduler.pending(),
            },
            "devices": devices,
        }


_CORRECT = CheckResult(ok=True, margin=0.0)  # what every simulated result earns


def _config_json(config: SimConfig) -> dict[str, Any]:
    return {k: v for k, v in vars(config).items()}


@functools.lru_cache(maxsize=4096)
def _cached_plan(shape: GemmShape, config: PlanConfig) -> GemmPlan | None:
    return plan_gemm(shape, config)


def simulate(config: SimConfig, devices: list[Device]) -> dict[str, Any]:
    return Simulation(config, devices).run()


def gemm_makespans(
    config: SimConfig, devices: list[Device], shapes: list[GemmShape]
) -> list[float]:
    """Each GEMM alone, one after another, planned and scheduled by the live code on a
    pool the coordinator already knows: seconds from planning to its last result (the
    makespan as executed, not as predicted). The simulated clock carries on between
    them, so each starts where the last one's stragglers left the pool."""
    stages = [[(f"g{i}", shape)] for i, shape in enumerate(shapes)]
    sim = Simulation(config, devices, stages=stages, known_pool=True)
    sim.run()
    return sim.stage_times


def stage_count(config: SimConfig) -> int:
    stages: list[Stage] = step_stages(
        MODELS[config.model], config.batch, config.seq, config.itemsize
    )
    return len(stages)
