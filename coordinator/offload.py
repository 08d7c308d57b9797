"""The bridge from the training thread to the server: offloaded GEMMs become tile jobs.

Runs on the training thread (slicing, encoding and signing tiles costs real time and
must not stall the event loop); hands finished jobs to the loop thread-safely.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.tensors import DTYPE_NAMES
from coordinator.costmodel import (
    LinkModel,
    candidate_configs,
    for_planning,
    plan_for_pool,
)
from coordinator.executor import GemmDone
from coordinator.planner import GemmPlan, GemmShape, PlanConfig, plan_gemm
from coordinator.server import CoordinatorServer, PoolView
from coordinator.tiling import TiledGemm

log = logging.getLogger("cleave.coordinator")

Index = tuple[int, int, int, int]


@dataclass(frozen=True)
class LivePlanning:
    """How live GEMMs are planned.

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
    # Links a worker has not shown yet are planned as 10 Gbit/s (costmodel.for_planning).
    optimistic_link_bps: float = 1.25e9
    # List scheduling costs tiles x workers per grid: bigger pools get plan_gemm's grid
    # (the pull scheduler still balances them; speculative copies cover the tail).
    max_workers: int = 64
    tiles_per_device: int = 4

    def plan(
        self, shape: GemmShape, pool: PoolView, config: PlanConfig
    ) -> tuple[GemmPlan | None, frozenset[Index]]:
        """The grid for one GEMM and the tiles kept at the coordinator. Raises ValueError
        (from plan_gemm) when not even a one-element tile fits the grid planner's limits."""
        if not self.cost_model or not pool.estimates or len(pool.estimates) > self.max_workers:
            return plan_gemm(shape, config), frozenset()
        share = self.coordinator_flops_per_s > 0
        chosen = plan_for_pool(
            shape,
            [for_planning(e, self.optimistic_link_bps) for e in pool.estimates],
            local_flops_per_s=self.coordinator_flops_per_s,
            base=config,
            links=LinkModel(window=self.window, tile_overhead_s=self.tile_overhead_s),
            share_local=share,
            tiles_per_device=self.tiles_per_device,
            configs=candidate_configs(config),
        )
        return chosen.plan, frozenset(t.index for t in chosen.local_tiles)


class TileOffload:
    """``GemmOffload`` that sends GEMMs to workers through a ``CoordinatorServer``."""

    def __init__(
        self,
        server: CoordinatorServer,
        loop: asyncio.AbstractEventLoop,
        key: Ed25519PrivateKey,
        plan_config: Callable[[int, int | None], PlanConfig],
        planning: LivePlanning = LivePlanning(),
    ) -> None:
        self._server = server
        self._loop = loop
        self._key = key
        self._plan_config = plan_config
        self._planning = planning

    def start(self, name: str, op: str, a: torch.Tensor, b: torch.Tensor, done: GemmDone) -> bool:
        if a.dtype not in DTYPE_NAMES or a.dtype != b.dtype or a.is_complex():
            return False
        batch, m, k = (a.shape[0], a.shape[1], a.shape[2]) if op == "bmm" else (1, *a.shape)
        n = b.shape[-1]
        shape = GemmShape(op=op, batch=batch, m=m, n=n, k=k, itemsize=a.element_size())
        pool = self._server.pool  # an immutable snapshot: safe to read from this thread
        config = self._plan_config(pool.active, pool.memory_cap)
        try:
            plan, local = self._planning.plan(shape, pool, config)
        except ValueError as exc:  # no tile of this GEMM fits: the coordinator computes it
            log.warning("running %s locally: %s", name, exc)
            return False
        if plan is None or len(local) == len(plan.tiles):
            return False  # all of it here: one GEMM is cheaper than its tiles
        gemm = TiledGemm(name, plan, a, b, on_done=done, local=local)
        for job in gemm.iter_jobs(self._key):
            self._loop.call_soon_threadsafe(self._server.submit, [job])
        if local:
            finished = gemm.compute_local()
            self._loop.call_soon_threadsafe(
                self._server.kept_here, gemm.gemm_id, len(local), finished
            )
        return True
