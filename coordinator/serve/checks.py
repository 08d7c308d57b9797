"""Checking returned tiles (Freivalds), placing verified tiles into their GEMMs, and
computing here the tiles no worker may take: ``Checker`` does each one, and
``CheckThread`` runs it off the event loop.

One thread, so the checker's private generator of check vectors needs no lock, and the
operand blocks' row norms are cached across the tiles that share a block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from common.ops import TileOp
from coordinator.tiles.tiled_gemm import SignedTile
from coordinator.tiles.verify import CheckCache, CheckResult, check_product, new_generator

T = TypeVar("T")


class Checker:
    """The work behind ``Check``, ``Deliver`` and compute-here effects; one thread at a time."""

    def __init__(self) -> None:
        self._vectors = new_generator()
        self._cache = CheckCache()

    def verdict(self, job: SignedTile, c: torch.Tensor) -> CheckResult:
        blocks = job.check_blocks if all(job.blocks) else None
        a, b = job.matrices()
        return check_product(a, b, c, self._vectors, cache=self._cache, blocks=blocks)

    @staticmethod
    def deliver(job: SignedTile, c: torch.Tensor) -> bool:
        """Place a verified tile; True when that completed its GEMM."""
        return job.gemm.deliver(job.region, c)

    @staticmethod
    def compute_here(job: SignedTile) -> bool:
        """Compute and place a tile here; True when that completed its GEMM."""
        a, b = job.matrices()
        product = torch.bmm(a, b) if job.gemm.op == TileOp.BMM else torch.mm(a, b)
        return job.gemm.deliver(job.region, product)


class CheckThread:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cleave-verify")
        self._checker = Checker()

    async def verdict(self, job: SignedTile, c: torch.Tensor) -> CheckResult:
        return await self._run(self._checker.verdict, job, c)

    async def deliver(self, job: SignedTile, c: torch.Tensor) -> bool:
        return await self._run(self._checker.deliver, job, c)

    async def compute_here(self, job: SignedTile) -> bool:
        return await self._run(self._checker.compute_here, job)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
