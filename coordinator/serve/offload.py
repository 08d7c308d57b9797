"""The bridge from the training thread to the pool: offloaded GEMMs become signed tiles.

Runs on the training thread (slicing, encoding and signing tiles costs real time and
must not stall the event loop); hands finished tiles to the loop thread-safely, to a
``TileSink``: the server, or a test's in-memory pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.gemm_speed import matmul_gflops
from common.ops import TileOp
from common.tensors import DTYPE_NAMES, stored_layout
from common.unfold import Unfold
from coordinator.plan.keep_home import KeepHome
from coordinator.plan.layouts import Layouts, Operand
from coordinator.plan.live import Commitments, LivePlanning
from coordinator.plan.planner import GemmShape, PlanConfig
from coordinator.pool.workers import PoolView
from coordinator.step.executor import GemmDone
from coordinator.step.gemm_names import step_of, traced
from coordinator.tiles.step_blocks import StepBlocks, memory_name
from coordinator.tiles.tiled_gemm import SignedTile, TiledGemm

log = logging.getLogger("cleave.coordinator")
DEFAULT_PLANNING = LivePlanning()


class TileSink(Protocol):
    """Where tiles go (``CoordinatorServer``); called on its event loop only."""

    @property
    def pool(self) -> PoolView: ...  # read from the training thread: a snapshot

    def submit(self, tiles: list[SignedTile]) -> None: ...

    def kept_here(self, gemm_id: str, tiles: int, finished: bool) -> None: ...


class TileOffload:
    """``GemmOffload`` that sends GEMMs to workers through a ``TileSink``."""

    def __init__(
        self,
        server: TileSink,
        loop: asyncio.AbstractEventLoop,
        key: Ed25519PrivateKey,
        plan_config: Callable[[int, int | None], PlanConfig],
        planning: LivePlanning = DEFAULT_PLANNING,
        keep_home: KeepHome | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``keep_home``: which GEMMs are cheaper computed here than handed out (None:
        every GEMM goes to the planner); ``clock``: when GEMMs are planned, which the
        workers' commitments to earlier plans are counted from."""
        self._server = server
        self._loop = loop
        self._key = key
        self._plan_config = plan_config
        self._planning = planning
        self._commitments = Commitments()  # training thread only, as start() is
        self._layouts = Layouts()  # likewise: this step's
        self._blocks = StepBlocks()  # likewise: the blocks this step has cut
        self._step: int | None = None
        self._clock = clock
        self._keep_home = keep_home
        self._speeds: dict[torch.dtype, float] = {}  # FLOP/s of a GEMM here, by dtype

    def start(
        self,
        name: str,
        op: str,
        a: torch.Tensor,
        b: torch.Tensor,
        done: GemmDone,
        unfold: Unfold | None = None,
    ) -> int:
        if a.dtype not in DTYPE_NAMES or a.dtype != b.dtype or a.is_complex():
            return 0
        a_shape, b_shape = tuple(a.shape), tuple(b.shape)
        if unfold is not None:  # plan the GEMM over the patch matrix
            if unfold.operand == "a":
                a_shape = unfold.matrix_shape(a_shape)
            else:
                b_shape = unfold.matrix_shape(b_shape)
        batch, m, k = (a_shape[0], a_shape[1], a_shape[2]) if op == TileOp.BMM else (1, *a_shape)
        n = b_shape[-1]
        shape = GemmShape(op=op, batch=batch, m=m, n=n, k=k, itemsize=a.element_size())
        if self._keep_home is not None and self._keep_home.keeps(
            shape, lambda: self._speed(a.dtype)
        ):
            return 0  # fewer FLOPs than bytes are worth: cheaper here than as tiles
        if step_of(name) != self._step:
            # A new step: the memory that last step's matrices lay in is another's now
            # (and the weights have changed), so its cuts name nothing any more.
            self._step, self._layouts, self._blocks = step_of(name), Layouts(), StepBlocks()
        pool = self._server.pool  # an immutable snapshot: safe to read from this thread
        config = self._plan_config(pool.active, pool.memory_cap)
        self._commitments.forget(e.worker_id for e in pool.estimates)
        try:
            # GEMMs already out keep their workers busy for a while: this one is planned
            # after them (the coordinator's share of them is done: start() computed it).
            choice = self._planning.plan(
                shape,
                pool.estimates,
                config,
                self._commitments,
                now=self._clock(),
                layouts=self._layouts,
                operands=(None, None) if unfold is not None else (operand(a), operand(b)),
            )
        except ValueError as exc:  # no tile of this GEMM fits: the coordinator computes it
            log.warning("running %s locally: %s", name, exc)
            return 0
        if choice.plan is None or choice.all_here:
            return 0  # all of it here: one GEMM is cheaper than its tiles
        local = choice.local
        gemm = TiledGemm(
            name,
            choice.plan,
            a,
            b,
            on_done=done,
            local=local,
            owners=choice.owners,
            unfold=unfold,
            # An eager step runs user code between its GEMMs, which may write a tensor
            # without moving its version: its blocks are hashed every time.
            step_blocks=self._blocks if traced(name) else None,
        )
        local = gemm.local
        sent = sum(r.flops for r in gemm.plan.tiles if r.index not in local)
        for tile in gemm.iter_tiles(self._key):
            self._loop.call_soon_threadsafe(self._server.submit, [tile])
        if local:
            finished = gemm.compute_local()
            self._loop.call_soon_threadsafe(
                self._server.kept_here, gemm.gemm_id, len(local), finished
            )
        return sent

    def _speed(self, dtype: torch.dtype) -> float:
        """FLOP/s of a GEMM in ``dtype`` on this thread, as it computes the GEMMs kept
        here; measured once per dtype (a CPU without bf16 units runs bf16 far slower than
        fp32: keeping its bf16 GEMMs here would cost more than it saves)."""
        if dtype not in self._speeds:
            # Its own generator: drawing from the global one would shift the training's
            # random stream (dropout masks) away from local torch's.
            a = torch.rand(256, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
            self._speeds[dtype] = matmul_gflops(a, a, target_s=0.02) * 1e9
        return self._speeds[dtype]


def operand(t: torch.Tensor) -> Operand | None:
    """A GEMM operand as ``Layouts`` names it: the memory its bytes lie in and their
    version (``memory_name``: the optimizer's step, in place, moves it on), and which
    way round the GEMM reads them. None for a tensor without a version (inference mode)."""
    name = memory_name(t)
    return None if name is None else Operand(name, stored_layout(t)[1])
