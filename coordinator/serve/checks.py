"""Decoding and checking returned tiles (Freivalds), placing verified tiles into their
GEMMs, and computing here the tiles no worker may take: ``Checker`` does each one, and
``CheckThread`` runs it off the event loop.

A result goes to the thread once: decoded, checked and, if it passes, placed in one
visit, so the event loop spends none of its own time on the result's bytes. The results
that queued up while the thread was busy are checked together, in one ``check_products``
call, and their verdicts come back to the loop in one hand-off. One thread, so the
checker's private generator of check vectors needs no lock, and the operand blocks'
summaries are cached across the tiles that share a block.

Small tiles are the exception: they are checked on the event loop itself, together.
A check is a few dozen torch calls whatever the tile's size, and each one releases the
GIL; while the event loop is busy (many workers), a thread that must take the GIL back
after every call waits for the loop's switch interval each time, so a small tile's
check that takes tens of microseconds alone waits milliseconds, and the results queue
up behind the thread. On the loop there is no hand-off, and the small results that
arrived in one turn of the loop are checked in one ``check_products`` call at the next,
a few calls for all of them (``bench/bench_load.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from common.errors import ProtocolError
from common.limits import DEFAULT_LIMITS, WireLimits
from common.ops import TileOp
from coordinator.pool.effects import Check, Checked
from coordinator.step.cpu_costs import COSTS
from coordinator.step.torch_threads import computing, orchestrate_on_one_thread, orchestrating
from coordinator.tiles import row_products
from coordinator.tiles.check_parts import CheckCache, new_generator
from coordinator.tiles.tiled_gemm import SignedTile
from coordinator.tiles.verify import check_products

T = TypeVar("T")
log = logging.getLogger("cleave.coordinator")

# Tiles of at most this many multiply-adds (128^3) are checked on the event loop: their
# check takes about as long as handing it to the thread and back.
ON_LOOP_MAX_MACS = 128**3
ON_LOOP_MAX_STACK = 256  # small results checked in one turn of the loop; the rest next turn
ON_THREAD_MAX_BATCH = 64  # large results the thread checks in one call


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
        return self.run_many([check])[0]

    def run_many(self, checks: Sequence[Check]) -> list[Checked]:
        """``run`` of each result, their checks in one ``check_products`` call."""
        decode, verify, assemble = self._stages
        outcomes: list[Checked] = [Checked(None)] * len(checks)
        decoded: list[tuple[int, SignedTile, torch.Tensor]] = []
        with COSTS.timed(decode):
            for i, check in enumerate(checks):
                if check.result is None:
                    continue
                if check.tile.gemm.placed(check.tile.region):
                    outcomes[i] = Checked(None, late=True)
                    continue
                try:
                    c = check.result.tensors(self._limits).get("c")
                except ProtocolError as exc:
                    outcomes[i] = Checked(None, error=exc)
                    continue
                if c is not None:
                    decoded.append((i, check.tile, c))
        with COSTS.timed(verify):
            results = check_products(
                [(*tile.matrices(), c) for _, tile, c in decoded],
                self._vectors,
                cache=self._cache,
                blocks=[tile.check_blocks if all(tile.blocks) else None for _, tile, _ in decoded],
                partners=[tile.check_partners for _, tile, _ in decoded],
            )
        # The GEMM is released by the pump once the core has credited the tile: no
        # training step goes on before the credit of the tiles it used is made.
        with COSTS.timed(assemble):
            for (i, tile, c), result in zip(decoded, results, strict=True):
                finished = result.ok and tile.gemm.deliver(tile.region, c, release=False)
                outcomes[i] = Checked(result, finished=finished)
        return outcomes

    @staticmethod
    def compute_here(tile: SignedTile) -> bool:
        """Compute and place a tile here; True when that completed its GEMM."""
        a, b = tile.matrices()
        with COSTS.timed("stranded_tiles"), computing():
            product = torch.bmm(a, b) if tile.gemm.op == TileOp.BMM else torch.mm(a, b)
        return tile.gemm.deliver(tile.region, product)


def _check_thread_started() -> None:
    COSTS.this_thread_is("checks")
    orchestrate_on_one_thread()  # a check reads memory at the speed one core gets


Done = Callable[[Check, "Checked | BaseException"], None]


class CheckThread:
    def __init__(self, limits: WireLimits = DEFAULT_LIMITS) -> None:
        row_products.kernels()  # compiled (or loaded) now, not in the first step's checks
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="cleave-verify", initializer=_check_thread_started
        )
        cache = CheckCache()  # shared: a block's summaries serve both checkers
        self._checker = Checker(limits, cache)
        # Its own generator: each checker's is used by one thread only.
        self._on_loop = Checker(limits, cache, stages=("check_on_loop",) * 3)
        self._waiting: list[tuple[Check, Done]] = []
        # Large results waiting for the thread, and whether it is draining them.
        self._lock = threading.Lock()
        self._queued: list[tuple[Check, Done]] = []
        self._draining = False

    def submit(self, check: Check, done: Done) -> None:
        """Check a result; ``done(check, outcome)`` is called on the event loop with its
        ``Checked``, or with what checking it raised. (A callback rather than a task
        per result: at thousands of small results a second, a task each costs more
        than their checks.)"""
        if check.tile.flops <= 2 * ON_LOOP_MAX_MACS:
            self._on_loop_soon(check, done)  # small: cheaper here (above)
        else:
            self._on_thread_soon(check, done)

    async def run(self, check: Check) -> Checked:
        """``submit``, awaited."""
        outcome: asyncio.Future[Checked] = asyncio.get_running_loop().create_future()

        def settle(_: Check, result: Checked | BaseException) -> None:
            if outcome.done():
                return  # the caller stopped waiting
            if isinstance(result, BaseException):
                outcome.set_exception(result)
            else:
                outcome.set_result(result)

        self.submit(check, settle)
        return await outcome

    def _on_loop_soon(self, check: Check, done: Done) -> None:
        self._waiting.append((check, done))
        if len(self._waiting) == 1:
            asyncio.get_running_loop().call_soon(self._check_waiting)

    def _check_waiting(self) -> None:
        """The small results waiting, checked together (at most a stack's worth)."""
        now, self._waiting = self._waiting[:ON_LOOP_MAX_STACK], self._waiting[ON_LOOP_MAX_STACK:]
        if self._waiting:
            asyncio.get_running_loop().call_soon(self._check_waiting)
        with orchestrating():  # a stack of small checks would wake torch's whole team
            outcomes = _outcomes(now, self._on_loop.run_many)
        _hand_back(outcomes)

    def _on_thread_soon(self, check: Check, done: Done) -> None:
        """Queue a result for the thread, which checks what is queued together (the
        tiles of one GEMM share their blocks' summaries and reads of a) and hands
        the verdicts back in one call: one hand-off each way per batch, not per tile."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._queued.append((check, done))
            start, self._draining = not self._draining, True
        if start:
            self._pool.submit(self._drain, loop)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """(On the thread.) Check what is queued, a batch at a time, until nothing is."""
        while True:
            with self._lock:
                batch = self._queued[:ON_THREAD_MAX_BATCH]
                del self._queued[:ON_THREAD_MAX_BATCH]
                if not batch:
                    self._draining = False
                    return
            settled = _outcomes(batch, self._checker.run_many)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_hand_back, settled)

    async def compute_here(self, tile: SignedTile) -> bool:
        return await self._run(self._checker.compute_here, tile)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_Settled = list[tuple[Check, Done, "Checked | BaseException"]]


def _outcomes(
    waiting: list[tuple[Check, Done]],
    run_many: Callable[[Sequence[Check]], list[Checked]],
) -> _Settled:
    """Each waiter with its outcome from ``run_many``, or with what it raised: a failing
    batch fails each of its waiters rather than leaving any waiting."""
    try:
        outcomes = run_many([check for check, _ in waiting])
    except Exception as exc:  # noqa: BLE001 - each waiter gets it, none hangs
        return [(check, done, exc) for check, done in waiting]
    return [(check, done, o) for (check, done), o in zip(waiting, outcomes, strict=True)]


def _hand_back(settled: _Settled) -> None:
    """(On the loop.) Each waiter's outcome; one that raises does not keep the others
    from theirs."""
    for check, done, outcome in settled:
        try:
            done(check, outcome)
        except Exception:  # noqa: BLE001 - said, and the next waiter still gets its own
            log.exception("handling the check of tile %s failed", check.tile_id)
