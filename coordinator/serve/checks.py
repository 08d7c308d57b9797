"""Decoding and checking returned tiles (Freivalds), placing verified tiles into their
GEMMs, and computing here the tiles no worker may take: ``Checker`` does each one, and
``CheckThread`` runs it off the event loop.

A result goes to the thread once: decoded, checked and, if it passes, placed in one
visit, so the event loop spends one hand-off per tile and none of its own time on the
result's bytes. One thread, so the checker's private generator of check vectors needs
no lock, and the operand blocks' row norms are cached across the tiles that share a
block.

Small tiles are the exception: they are checked on the event loop itself. Their check
is a few dozen tiny torch calls, and each one releases the GIL; while the event loop is
busy (many workers), a thread that must take the GIL back after every call waits for
the loop's switch interval each time, so a check that takes tens of microseconds alone
waits milliseconds, and the results queue up behind the thread. On the loop the same
check costs its own time and no hand-off (``bench/bench_load.py``).
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

# Tiles of at most this many multiply-adds (128^3) are checked on the event loop: their
# check takes about as long as handing it to the thread and back.
ON_LOOP_MAX_MACS = 128**3


class Checker:
    """The work behind ``Check`` and compute-here effects; one thread at a time."""

    def __init__(
        self,
        limits: WireLimits = DEFAULT_LIMITS,
        cache: CheckCache | None = None,
        *,
        stages: tuple[str, str, str] = ("decode", "check", "assemble"),
    ) -> None:
        """``stages``: the CPU-cost stages (``COSTS``) its decode, check and placing
        count under."""
        self._limits = limits
        self._vectors = new_generator()
        self._cache = CheckCache() if cache is None else cache
        self._stages = stages

    def run(self, check: Check) -> Checked:
        """Decode the result, check it, and place it if it passes."""
        if check.result is None:
            return Checked(None)
        decode, verify, assemble = self._stages
        try:
            with COSTS.timed(decode):
                c = check.result.tensors(self._limits).get("c")
        except ProtocolError as exc:
            return Checked(None, error=exc)
        if c is None:
            return Checked(None)
        job = check.job
        with COSTS.timed(verify):
            verdict = self.verdict(job, c)
        # The GEMM is released by the pump once the core has credited the tile: no
        # training step goes on before the credit of the tiles it used is made.
        with COSTS.timed(assemble):
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
        cache = CheckCache()  # shared: a block's summaries serve both checkers
        self._checker = Checker(limits, cache)
        # Its own generator: each checker's is used by one thread only.
        self._on_loop = Checker(limits, cache, stages=("check_on_loop",) * 3)

    async def run(self, check: Check) -> Checked:
        if check.job.flops <= 2 * ON_LOOP_MAX_MACS:
            return self._on_loop.run(check)  # small: cheaper here than a hand-off (above)
        return await self._run(self._checker.run, check)

    async def compute_here(self, job: SignedTile) -> bool:
        return await self._run(self._checker.compute_here, job)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
