"""The check thread: each returned tile's Freivalds check, placing verified tiles into
their GEMMs, and computing here the tiles no worker may take, off the event loop.

One thread, so its private generator of check vectors needs no lock, and the operand
blocks' row norms are cached across the tiles that share a block.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from common.ops import TileOp
from coordinator.tiles.tiled_gemm import SignedTile
from coordinator.tiles.verify import CheckCache, CheckResult, check_product, new_generator


class CheckThread:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cleave-verify")
        self._vectors = new_generator()
        self._cache = CheckCache()

    async def verdict(self, job: SignedTile, c: torch.Tensor) -> CheckResult:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._check, job, c)

    async def deliver(self, job: SignedTile, c: torch.Tensor) -> bool:
        """Place a verified tile; True when that completed its GEMM."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, job.gemm.deliver, job.region, c)

    async def compute_here(self, job: SignedTile) -> bool:
        """Compute and place a tile here; True when that completed its GEMM."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, _compute, job)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check(self, job: SignedTile, c: torch.Tensor) -> CheckResult:
        blocks = job.check_blocks if all(job.blocks) else None
        a, b = job.matrices()
        return check_product(a, b, c, self._vectors, cache=self._cache, blocks=blocks)


def _compute(job: SignedTile) -> bool:
    a, b = job.matrices()
    product = torch.bmm(a, b) if job.gemm.op == TileOp.BMM else torch.mm(a, b)
    return job.gemm.deliver(job.region, product)
