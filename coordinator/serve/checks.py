"""Decoding and checking returned tiles (Freivalds), placing verified tiles into their
GEMMs, and computing here the tiles no worker may take: ``Checker`` does each one, and
``CheckThread`` runs it off the event loop.

A result goes to the thread once: decoded, checked and, if it passes, placed in one
visit, so the event loop spends one hand-off per tile and none of its own time on the
result's bytes. One thread, so the checker's private generator of check vectors needs
no lock, and the operand blocks' row norms are cached across the tiles that share a
block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from common.errors import ProtocolError
from common.limits import DEFAULT_LIMITS, WireLimits
from common.ops import TileOp
from coordinator.pool.effects import Check, Checked
from coordinator.step.cpu_costs import COSTS
from coordinator.tiles.tiled_gemm import SignedTile
from coordinator.tiles.verify import CheckCache, CheckResult, check_product, new_generator

T = TypeVar("T")


class Checker:
    """The work behind ``Check`` and compute-here effects; one thread at a time."""

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._vectors = new_generator()
        self._cache = CheckCache()

    def run(self, check: Check) -> Checked:
        """Decode the result, check it, and place it if it passes."""
        if check.result is None:
            return Checked(None)
        try:
            with COSTS.timed("decode"):
                c = check.result.tensors(self._limits).get("c")
        except ProtocolError as exc:
            return Checked(None, error=exc)
        if c is None:
            return Checked(None)
        job = check.job
        with COSTS.timed("check"):
            verdict = self.verdict(job, c)
        # The GEMM is released by the pump once the core has credited the tile: no
        # training step goes on before the credit of the tiles it used is made.
        with COSTS.timed("assemble"):
            finished = verdict.ok and job.gemm.deliver(job.region, c, release=False)
        return Checked(verdict, finished=finished)

    def verdict(self, job: SignedTile, c: torch.Tensor) -> CheckResult:
        blocks = job.check_blocks if all(job.blocks) else None
        a, b = job.matrices()
        return check_product(a, b, c, self._vectors, cache=self._cache, blocks=blocks)

    @staticmethod
    def compute_here(job: SignedTile) -> bool:
        """Compute and place a tile here; True when that completed its GEMM."""
        a, b = job.matrices()
        with COSTS.timed("stranded_tiles"):
            product = torch.bmm(a, b) if job.gemm.op == TileOp.BMM else torch.mm(a, b)
        return job.gemm.deliver(job.region, product)


class CheckThread:
    def __init__(self, limits: WireLimits = DEFAULT_LIMITS) -> None:
        self._pool = ThreadPoolExecutor(
            1,
            thread_name_prefix="cleave-verify",
            initializer=COSTS.this_thread_is,
            initargs=("checks",),
        )
        self._checker = Checker(limits)

    async def run(self, check: Check) -> Checked:
        return await self._run(self._checker.run, check)

    async def compute_here(self, job: SignedTile) -> bool:
        return await self._run(self._checker.compute_here, job)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
