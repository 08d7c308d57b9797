"""How the GEMMs planned so far cut the matrices that later GEMMs read again, and which
worker each block was placed on: grids that cut a matrix alike send no worker a block
it holds already.

A training step reads every GEMM operand twice: a linear layer's weight in its forward
and its input gradient, its input in its forward and its weight gradient, its output
gradient in both gradients. A grid chosen for each GEMM on its own rarely cuts such a
matrix into the blocks an earlier GEMM cut it into, and a worker's operand cache (keyed
by content) then holds nothing the second GEMM sends. So the planner also tries, for
each GEMM, the grids that cut its operands as earlier plans did (`Layouts.variants`),
and counts the blocks those plans placed on each worker as held there
(`Layouts.held`); the cost model picks such a grid where the bytes it saves are worth
more than what it costs (a K split returns partial sums, for one).

Pure: the caller names each operand by the identity of the memory it lies in (the
training thread: where its bytes are and their version). A wrong identity (freed memory
reused by another matrix of the same shape) can only make a plan send bytes it thought
held: what a worker is sent and keeps is named by content, never by these names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from common.block_cache import BlockCache
from coordinator.plan.placement import LOCAL, Block, Placement
from coordinator.plan.planner import GemmShape, Grid, TileRegion

# (b0, b1, r0, r1, c0, c1): a block of a matrix as its bytes lie, by batch, row and
# column ranges.
Region = tuple[int, int, int, int, int, int]
Dims = tuple[int, int, int]  # (batch, rows, columns) of a matrix as it lies, or parts of them


@dataclass(frozen=True)
class Operand:
    """One operand of a GEMM as the planner knows it."""

    key: Hashable  # the matrix as its bytes lie: the same for every view of that memory
    # The GEMM reads it transposed: A's bytes lie as [batch, K, M], B's as [batch, N, K].
    transposed: bool = False


def _stored(dims: Dims, transposed: bool) -> Dims:
    """(batch, rows, columns) of an operand read as `dims` (batch, GEMM rows, GEMM
    columns), as its bytes lie; the same swap takes parts and ranges back."""
    return (dims[0], dims[2], dims[1]) if transposed else dims


def _operand_dims(shape: GemmShape, grid: Grid, name: str) -> tuple[Dims, Dims]:
    """Sizes and parts of operand `name` ("A": [b, M, K], "B": [b, K, N]) in the GEMM's
    own order."""
    gb, gm, gn, gk = grid
    if name == "A":
        return (shape.batch, shape.m, shape.k), (gb, gm, gk)
    return (shape.batch, shape.k, shape.n), (gb, gk, gn)


def _gemm_region(tile: TileRegion, name: str) -> Region:
    """The block of operand `name` that `tile` reads, in the GEMM's order (as
    placement.operand_blocks names it)."""
    t = tile
    if name == "A":
        return (t.b0, t.b1, t.m0, t.m1, t.k0, t.k1)
    return (t.b0, t.b1, t.k0, t.k1, t.n0, t.n1)


def _swap(region: Region, transposed: bool) -> Region:
    b0, b1, r0, r1, c0, c1 = region
    return (b0, b1, c0, c1, r0, r1) if transposed else region


@dataclass
class _Cut:
    sizes: Dims  # the matrix as its bytes lie
    parts: Dims  # how the last plan that read it cut it, in the same order
    # Which workers were given each block, by the plans that read it.
    holders: dict[str, set[Region]]


class Layouts:
    """What the plans made so far did with the matrices they read; for the training
    thread that plans (as ``live.Commitments``). Remembers the last `matrices` matrices,
    and for each worker the blocks placed on it up to `worker_bytes` (least recently
    placed forgotten first, as a worker's cache drops them), or its memory cap where
    that is smaller."""

    def __init__(self, matrices: int = 1024, worker_bytes: int = 1 << 30) -> None:
        self._matrices = matrices
        self._worker_bytes = worker_bytes
        self._cuts: OrderedDict[Hashable, _Cut] = OrderedDict()
        # Each worker's cache as the plans filled it, by the same rule as the worker's own.
        self._caches: dict[str, BlockCache[tuple[Hashable, Region], int]] = {}

    def _cut(self, shape: GemmShape, operand: Operand, name: str) -> _Cut | None:
        """The operand's last cut, if it is of a matrix of this operand's sizes."""
        cut = self._cuts.get(operand.key)
        sizes, _ = _operand_dims(shape, (1, 1, 1, 1), name)
        if cut is None or cut.sizes != _stored(sizes, operand.transposed):
            return None
        return cut

    def variants(
        self, shape: GemmShape, operands: Sequence[Operand | None], grids: Iterable[Grid]
    ) -> list[Grid]:
        """`grids`, each changed to cut A, B, or both as their last plans did; the grids
        that are new, in order. (A and B both fix K's parts: where they differ, a grid
        can follow one of them.)"""
        fixes: list[dict[int, int]] = []
        for name, operand, dims in zip("AB", operands, ((0, 1, 3), (0, 3, 2)), strict=True):
            cut = None if operand is None else self._cut(shape, operand, name)
            if operand is not None and cut is not None:
                parts = _stored(cut.parts, operand.transposed)  # back in the GEMM's order
                fixes.append(dict(zip(dims, parts, strict=True)))
        if len(fixes) == 2 and all(fixes[0][d] == fixes[1][d] for d in (0, 3)):
            fixes.append({**fixes[0], **fixes[1]})
        seen = set(grids)
        found: list[Grid] = []
        for grid in list(seen):
            for fix in fixes:
                changed = tuple(fix.get(d, parts) for d, parts in enumerate(grid))
                if changed not in seen:
                    seen.add(changed)  # type: ignore[arg-type]
                    found.append(changed)  # type: ignore[arg-type]
        return sorted(found)

    def later_bytes(self, shape: GemmShape, operands: Sequence[Operand | None], grid: Grid) -> int:
        """Bytes a later GEMM of the step would move because `grid` cuts a matrix read
        here for the first time along the dim that GEMM sums over.

        Backpropagation reads each operand of ``C = A B`` once more: ``A`` in ``Aᵀ dC``
        (summed over A's M rows), ``B`` in ``dC Bᵀ`` (summed over B's N columns). A matrix
        cut into p parts along that dim is either sent again (the later GEMM cuts it
        otherwise) or held in p blocks by a later grid that splits its K as many ways
        and returns p partial outputs (K x N for A, M x K for B) where one would do: the
        smaller of the two. A matrix read before (an earlier GEMM's cut is known) adds
        nothing: this is that later read."""
        _, gm, gn, _ = grid
        extra = 0
        if operands[0] is not None and operands[0].key not in self._cuts and gm > 1:
            extra += min((gm - 1) * shape.k * shape.n, shape.m * shape.k)
        if operands[1] is not None and operands[1].key not in self._cuts and gn > 1:
            extra += min((gn - 1) * shape.m * shape.k, shape.k * shape.n)
        return extra * shape.batch * shape.itemsize

    def held(
        self, shape: GemmShape, operands: Sequence[Operand | None]
    ) -> dict[str, frozenset[Block]]:
        """The blocks of this GEMM's operands that earlier plans placed on each worker,
        named as ``placement.operand_blocks`` names them."""
        held: dict[str, set[Block]] = {}
        for name, operand in zip("AB", operands, strict=True):
            cut = None if operand is None else self._cut(shape, operand, name)
            if operand is None or cut is None:
                continue
            for worker, regions in cut.holders.items():
                mine = held.setdefault(worker, set())
                mine.update((name, *_swap(r, operand.transposed)) for r in regions)
        return {worker: frozenset(blocks) for worker, blocks in held.items()}

    def record(
        self,
        shape: GemmShape,
        grid: Grid,
        operands: Sequence[Operand | None],
        placements: Iterable[Placement],
        caps: Mapping[str, int | None],
    ) -> None:
        """A plan of `shape` on `grid`: its cut of each operand, and the blocks each
        placed tile's worker now holds (`caps`: the workers' memory caps)."""
        cuts: list[tuple[str, Operand, _Cut]] = []
        for name, operand in zip("AB", operands, strict=True):
            if operand is None:
                continue
            sizes, parts = _operand_dims(shape, grid, name)
            stored = _stored(sizes, operand.transposed)
            cut = self._cuts.pop(operand.key, None)
            if cut is None or cut.sizes != stored:
                cut = _Cut(stored, parts, {})
            cut.parts = _stored(parts, operand.transposed)
            self._cuts[operand.key] = cut  # the most recently cut last
            cuts.append((name, operand, cut))
        while len(self._cuts) > self._matrices:
            # Its blocks stay in the workers' caches until they are let go, as there.
            self._cuts.popitem(last=False)
        for p in placements:
            if p.worker_id == LOCAL:
                continue
            for name, operand, cut in cuts:
                region = _swap(_gemm_region(p.tile, name), operand.transposed)
                size = _region_bytes(region, shape.itemsize)
                self._place(p.worker_id, operand.key, cut, region, size, caps.get(p.worker_id))

    def _place(
        self, worker: str, key: Hashable, cut: _Cut, region: Region, size: int, cap: int | None
    ) -> None:
        cache = self._caches.get(worker)
        if cache is None:
            budget = self._worker_bytes if cap is None else min(cap, self._worker_bytes)
            cache = self._caches[worker] = BlockCache(budget, int)
        cut.holders.setdefault(worker, set()).add(region)
        for gone_key, gone in cache.record([((key, region), size)]):
            gone_cut = self._cuts.get(gone_key)
            if gone_cut is not None:
                gone_cut.holders.get(worker, set()).discard(gone)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop workers that left (the caller passes those still there)."""
        alive = set(keep)
        for worker in [w for w in self._caches if w not in alive]:
            for key, _region in self._caches.pop(worker):
                cut = self._cuts.get(key)
                if cut is not None:
                    cut.holders.pop(worker, None)


def _region_bytes(region: Region, itemsize: int) -> int:
    b0, b1, r0, r1, c0, c1 = region
    return itemsize * (b1 - b0) * (r1 - r0) * (c1 - c0)
