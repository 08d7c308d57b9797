"""What one simulation runs: the model and batch, the planner and scheduler settings, the
coordinator's links and CPU, and its ranks."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.plan.live import Planner
from coordinator.sim.baselines import ring_allreduce_bytes
from coordinator.sim.models import MODELS, param_count


@dataclass(frozen=True)
class SimConfig:
    model: str = "opt-125m"
    batch: int = 4
    seq: int = 512
    itemsize: int = 4
    steps: int = 1
    planner: Planner = Planner.GRID
    window: int = 2
    coordinator_gflops: float = 500.0  # the coordinator's own GEMMs (small ones, stranded)
    # With the cost-model planner, the coordinator computes the tiles it would finish
    # first (LivePlanning's share), as `serve --coordinator-gflops` does.
    coordinator_share: bool = True
    coordinator_egress_bps: float = 1.25e9  # 10 Gbit/s, shared by every download
    min_offload_flops: int = 1_000_000
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    tile_timeout_s: float = 120.0
    speculate_after: float | None = None
    leave_for_faster: float | None = None  # SchedulerConfig.leave_for_faster
    # The cost-model planner's placement rule (LivePlanning.rule) and whether tickets name
    # the worker each tile was placed on (TileTicket.planned_for), as the live offload's
    # do; without, every tile goes to the first free slot (pull).
    placement: str = "auto"
    follow_plan: bool = True
    # Workers keep the operand blocks they were sent (budget: their memory cap, LRU) and
    # the coordinator sends only the blocks a worker does not hold, preferring a worker
    # that holds one of a tile's blocks (coordinator/pool/workers.py `Worker.task_frame`).
    operand_cache: bool = True
    # The coordinator's CPU for each tile it hands out: a fixed part (scheduling,
    # framing, signing, crediting) and a part per byte sent and received (cutting,
    # hashing, sending, decoding, checking), on its one event loop's core; a tile's
    # download waits for it. 0 and 0: the coordinator's CPU is free (sections a-e of
    # the report); docs/simulation.md's ranks section takes them from the benches.
    coordinator_cpu_per_tile_s: float = 0.0
    coordinator_cpu_per_byte_s: float = 0.0
    # Coordinator ranks (DESIGN.md §7): each has its own egress and CPU, serves the
    # devices dealt to it in turn, as the front door spreads joining workers, and trains
    # on its slice of the batch; the gradients are then all-reduced over the ranks'
    # links (a ring: ``baselines.ring_allreduce_bytes``). The ranks are
    # alike, so rank 0 is simulated with its devices and the step waits for the
    # all-reduce after the backward, as the trainer does.
    ranks: int = 1
    rank_link_bps: float = 1.25e9
    max_sim_s: float = 1e7  # give up (and say so) rather than loop forever

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; one of {sorted(MODELS)}")
        object.__setattr__(self, "planner", Planner(self.planner))  # "grid" or "cost" too
        if self.ranks < 1 or self.batch % self.ranks:
            raise ValueError(
                f"batch {self.batch} does not split across {self.ranks} ranks: "
                "the batch must be a multiple of the ranks"
            )

    @property
    def allreduce_s(self) -> float:
        """One step's gradient all-reduce between the ranks (0 for one rank)."""
        grads = param_count(MODELS[self.model]) * self.itemsize
        return ring_allreduce_bytes(grads, self.ranks) / self.rank_link_bps
