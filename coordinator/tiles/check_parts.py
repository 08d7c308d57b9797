"""What a result check is made of: its secret vectors, how it cuts a tile's shape
(``CheckPlan``), what it needs of each operand block (row norms, ``b ρ``: the summaries)
and the ``CheckCache`` that shares those between the tiles of a block.
``coordinator.tiles.verify`` says how they make a check."""

from __future__ import annotations

import math
import secrets
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

import numpy as np
import torch

from common.tensors import stored_layout
from coordinator.tiles import row_products

SPLIT_ABOVE = 1 << 18  # K times a statistic's width beyond which rows are split
MAX_CHUNKS = 32  # column chunks per row, and at most one per 128 columns (below)
K_BLOCK = 256  # longest fp32 chain of the reference a (b ρ) on split tiles
LOOKS = 64  # statistics a tile gets at least, where its shape allows (more vectors)
# Rows are independent looks at a dense error only when the rows of c differ; where they
# share one direction (non-negative activations, a large common mean) every row's c ρ
# is about the same number, so an error along that direction escapes every row at once
# when the vector happens to be nearly orthogonal to it. Only the vectors are
# independent: with four, all four must be.
MIN_VECTORS = 4
MAX_VECTORS = 8


def new_generator() -> torch.Generator:
    """A private, unpredictable source of check vectors.

    Never the global RNG: that one is predictable from the job's seed (a cheater could
    craft results that pass) and drawing from it would shift the training's own random
    stream (dropout masks).
    """
    return torch.Generator().manual_seed(secrets.randbits(63))


def check_vectors(
    width: int, count: int, dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    """``count`` secret vectors of ``width`` entries, as columns: random sign, magnitude
    uniform in [1, 2).

    Bounded away from zero, so one wrong entry moves its statistic by at least its own
    error; continuous magnitudes, so errors in two entries cancel only by chance.
    """
    signed = torch.rand(width, count, dtype=dtype, generator=generator).mul_(2.0).sub_(1.0)
    return signed.add_(torch.ones_like(signed).copysign_(signed))  # [-1, 1) -> ±[1, 2)


def _fewest_parts(size: int, longest: int, most: int) -> int:
    """The fewest equal parts of ``size`` no longer than ``longest``, at most ``most``;
    ``most`` parts (or the nearest count that divides ``size``) when none is short enough."""
    for parts in range(-(-size // longest), most + 1):
        if size % parts == 0:
            return parts
    return next(p for p in range(min(size, most), 0, -1) if size % p == 0)


def times_skinny(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``x @ v`` for a tall ``x [..., r, w]`` and a skinny ``v [..., w, V]`` (V a few
    columns), as ``(vᵀ xᵀ)ᵀ``: BLAS packs the left operand of a product, and in ``x @ v``
    that is all of ``x``, which made these products several times slower than a pass
    over ``x``; with ``vᵀ`` on the left only the small one is packed and ``x`` is read
    once, in place (``xᵀ`` is a view). The sums are the same dot products: each still a
    chain over ``w`` at most, which is what the rounding model assumes."""
    return (v.transpose(-1, -2) @ x.transpose(-1, -2)).transpose(-1, -2)


def as_float64(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64, laid out in order (``times_skinny`` answers a transposed view)."""
    return t.to(torch.float64, memory_format=torch.contiguous_format)


# Row slices of this many elements at most are multiplied one at a time: the skinny
# product reads a slice that stays in the core's cache faster than a whole large block.
SLICE_ELEMENTS = 1 << 17


def rows_times_each(
    xs: Sequence[torch.Tensor],
    width: int,
    v: torch.Tensor,
    norms_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each of ``xs`` (one shape) cut into rows of ``width`` (its last dim a whole number
    of them), each row times ``v [width, V]``: ``[len(xs), rows, V]`` for every row of
    every chunk, each product written straight into one buffer for all, so they are
    joined without a copy. ``norms_into`` (``[len(xs), rows]``), where given, takes each
    row's 2-norm (``chunk_norms``), read while its slice is still in cache.

    An ``x`` that lies transposed (a weight block, as sent) is read in place: cutting
    its rows would copy it across memory, and ``vᵀ`` times its bytes' rows is the
    skinny product again."""
    # vᵀ, the product's packed left operand, laid out in order: as a strided view some
    # BLAS builds (MKL on AVX-512) took a path several times slower for it with a few
    # columns, and read x at a fraction of memory speed.
    v_t = v.mT.contiguous()
    out = torch.empty(len(xs), v.shape[-1], xs[0].numel() // width, dtype=v.dtype)
    step = max(1, SLICE_ELEMENTS // width)
    # numba's loops (coordinator.tiles.row_products), where it has them
    compiled = row_products.kernels()
    for i, x in enumerate(xs):
        into = out[i]
        transposed = stored_layout(x)[1]
        norms = norms_into[i] if norms_into is not None else None
        if compiled is not None and compiled.row_products(x, width, v_t, into, norms, transposed):
            continue
        if transposed:
            *lead, rows, cols = x.shape
            chunks = cols // width
            projected = v_t @ x.mT.reshape(*lead, chunks, width, rows)  # [..., chunks, V, rows]
            into.mT.copy_(projected.movedim(-1, -3).reshape(-1, v.shape[-1]))
            if norms is not None:
                norms.copy_(chunk_norms(x, chunks, width).reshape(-1))
            continue
        cut = x.reshape(-1, width)
        for span in (slice(s, s + step) for s in range(0, cut.shape[0], step)):
            torch.mm(v_t, cut[span].mT, out=into[:, span])  # times_skinny's (vᵀ xᵀ)
            if norms is not None:
                torch.linalg.vector_norm(cut[span], dim=-1, out=norms[span])
    return out.mT


def chunk_norms(x: torch.Tensor, chunks: int, width: int) -> torch.Tensor:
    """The 2-norms of ``x``'s rows (float32 or float64, the check's work dtypes) cut into
    ``chunks`` of ``width``: ``[..., rows, chunks]``.

    An ``x`` that lies transposed is reduced in the order its bytes lie: ``vector_norm``
    reads a dim that is not contiguous one element at a time, many times slower, and
    torch's sums over a leading dim go through a squared copy, whose writes cost more
    than the reads. numpy's ``einsum`` sums the squares as it reads them."""
    if not stored_layout(x)[1]:
        return torch.linalg.vector_norm(x.reshape(*x.shape[:-1], chunks, width), dim=-1)
    stored = x.detach().mT.reshape(*x.shape[:-2], chunks, width, x.shape[-2]).numpy()
    return torch.from_numpy(np.einsum("...cwr,...cwr->...rc", stored, stored)).sqrt_()


# A norm summed in fp32 loses the squares of entries below about 1e-19 (subnormal, and
# below about 3e-23 zero): a row of such entries, the gradients of a model that fits its
# batch well, reads as nearly zero, and the honest rounding of its products would look
# like a wrong result. Rows whose fp32 norm is below this are summed again in float64;
# above it, what the squares lost is below fp32's own rounding of the norm for rows of up
# to 2**22 entries.
NORM_FLOOR = 2.0**-52


def chunk_norms64(x: torch.Tensor, chunks: int, width: int) -> torch.Tensor:
    """``chunk_norms`` in float64, with those of rows whose fp32 norms underflowed summed
    again (``_repair_norms_``)."""
    norms = chunk_norms(x, chunks, width).to(torch.float64)
    _repair_norms_(norms, x, chunks, width)
    return norms


def _repair_norms_(norms: torch.Tensor, x: torch.Tensor, chunks: int, width: int) -> None:
    """Sum again in float64 the norms in ``norms`` (float64, ``chunk_norms(x, chunks,
    width)`` as fp32 summed them: ``[..., rows, chunks]`` for ``x [..., rows, cols]``) of
    the rows where one is below ``NORM_FLOOR``. Only those rows are read again, so a
    tile of ordinary magnitudes pays for the smallest of its norms."""
    if x.dtype != torch.float32:
        return  # float64 squares underflow only below 1e-154
    if not norms.numel() or float(norms.min()) >= NORM_FLOOR:
        return
    small = (norms < NORM_FLOOR).any(dim=-1)  # (a NaN norm is no reason to sum again)
    if not bool(small.any()):
        return
    rows = small.nonzero(as_tuple=True)
    again = x[rows].to(torch.float64).reshape(-1, chunks, width)  # those rows alone
    norms[rows] = torch.linalg.vector_norm(again, dim=-1)


@dataclass(frozen=True)
class CheckPlan:
    """How the check cuts one tile shape: ``rows`` output rows (all batches), each cut
    into ``chunks`` column chunks of ``width``, ``vectors`` statistics per chunk, and
    the reference summed over K in ``k_blocks`` blocks."""

    rows: int
    chunks: int
    width: int
    vectors: int
    k_blocks: int

    @classmethod
    @lru_cache(maxsize=4096)
    def for_shape(cls, batch: int, m: int, k: int, n: int) -> CheckPlan:
        rows = batch * m
        # A tile with few rows gets more vectors (independent looks at a dense error).
        vectors = min(MAX_VECTORS, n, max(MIN_VECTORS, -(-LOOKS // rows)))
        # The reference a (b ρ) has a column per chunk and vector, and its cost grows
        # with them: one per 128 columns of the tile adds under 1% to the GEMM's FLOPs.
        most = max(1, min(MAX_CHUNKS, n // 128 // vectors))
        chunks = _fewest_parts(n, max(1, SPLIT_ABOVE // k), most)
        width = n // chunks
        vectors = min(vectors, width)  # beyond the width the statistics repeat one another
        # Large tiles also sum the reference in short blocks of K (below, the plain
        # product is faster and its rounding is modelled as it is).
        k_blocks = _fewest_parts(k, K_BLOCK, 4 * -(-k // K_BLOCK)) if k * n > SPLIT_ABOVE else 1
        if k_blocks > 1 and (k // k_blocks) * 4 < K_BLOCK:
            k_blocks = 1  # K has no divisor near the block length: one chain
        return cls(rows, chunks, width, vectors, k_blocks)

    @property
    def statistics(self) -> int:
        return self.rows * self.chunks * self.vectors


@dataclass(frozen=True)
class LeftSummary:
    """What the check needs of ``a`` besides ``a`` itself: its squared row norms."""

    row_sq: torch.Tensor  # [batch, m] float64


@dataclass(frozen=True)
class RightSummary:
    """What the check needs of ``b`` for one plan: the vectors it drew, ``b ρ``, and the
    row norms of each column chunk: their largest (squared), and the norms themselves
    where they are so uneven that the bound on the terms built from the largest would be
    loose (None otherwise)."""

    vectors: torch.Tensor  # ρ, [width, V]
    projected: torch.Tensor  # b ρ, [batch, k, chunks * V]
    largest_row_sq: torch.Tensor  # max_l ||b[l, chunk]||², [batch, chunks] float64
    uneven_row_sq: torch.Tensor | None  # ||b[l, chunk]||², [batch, k, chunks] float64
    # In a stack of tiles (check_products) where only some are uneven: which, [tiles].
    uneven_tiles: torch.Tensor | None = None


UNEVEN = 4.0  # largest over mean squared row norm of b beyond which terms are summed exactly
RHO_SQ = 4.0  # the largest square of a check vector's entry: |ρ| < 2


def summarize_left(a3: torch.Tensor | Sequence[torch.Tensor]) -> LeftSummary:
    """``a3``: one operand, or the distinct blocks of a stack of tiles (each
    ``[batch, m, k]``), summarised one by one and joined: the blocks are not copied into
    a stack."""
    blocks = [a3] if isinstance(a3, torch.Tensor) else a3
    row_sq = [chunk_norms64(block, 1, block.shape[-1])[..., 0] for block in blocks]
    return LeftSummary(_summaries_joined(row_sq).square_())


def summarize_right(
    b3: torch.Tensor | Sequence[torch.Tensor],
    plan: CheckPlan,
    generator: torch.Generator,
    tiles: int = 1,
) -> RightSummary:
    """``b3``: one operand stacking ``tiles`` tiles (each ``batch / tiles`` of its batches),
    or the distinct blocks of a stack of tiles (each ``[batch, k, n]``, one tile each),
    summarised one by one with the same vectors and joined: the blocks are not copied
    into a stack.
    Each tile is uneven or not on its own."""
    if isinstance(b3, torch.Tensor):
        blocks = [b3]
    else:
        blocks, tiles = list(b3), len(b3)
    rho = check_vectors(plan.width, plan.vectors, blocks[0].dtype, generator)
    # Chains of a chunk: [batch, k, chunks * V].
    batch, k, _ = blocks[0].shape
    norms = torch.empty(len(blocks), batch * k * plan.chunks, dtype=rho.dtype)
    projected = rows_times_each(blocks, plan.width, rho, norms).reshape(
        -1, k, plan.chunks * plan.vectors
    )
    norms = norms.to(torch.float64).view(len(blocks), batch, k, plan.chunks)
    for block, its_norms in zip(blocks, norms, strict=True):
        _repair_norms_(its_norms, block, plan.chunks, plan.width)
    norms = norms.view(-1, k, plan.chunks)  # [batch, k, chunks]
    largest = norms.amax(dim=1)
    # The mean square over l is the norm of the norms over sqrt(k).
    spread = largest > math.sqrt(UNEVEN / k) * torch.linalg.vector_norm(norms, dim=1)
    uneven = spread.view(tiles, -1).any(dim=1)  # [tiles]
    count = int(uneven.sum())
    row_sq = norms.square() if count else None
    mixed = uneven if 0 < count < tiles else None
    return RightSummary(rho, projected, largest.square_(), row_sq, mixed)


def _summaries_joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Summaries of blocks along their batch dimension: no copy for one."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(frozen=True)
class KeptReference:
    """The reference ``a (b ρ)`` of one tile, made ahead with its row's (``verify``),
    and the summary of ``b`` whose ρ it used: it is the tile's only while that summary
    is the one the cache hands out."""

    right: RightSummary
    values: torch.Tensor  # [batch, m, chunks * V] float64


_Summary = TypeVar("_Summary", LeftSummary, RightSummary, KeptReference)


class CheckCache:
    """Operand summaries shared by the tiles of one operand block (by its content id),
    so a block's row norms and ``b ρ`` are computed once, not once per tile. Reusing ρ
    across the tiles of a block is as sound as a fresh one: workers never see it.
    Thread-safe; keeps the most recently used summaries within ``budget_bytes``."""

    def __init__(self, budget_bytes: int = 128 << 20) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[Hashable, LeftSummary | RightSummary | KeptReference] = (
            OrderedDict()
        )
        self._bytes = 0
        self._lock = threading.Lock()

    def left(self, key: Hashable, a3: torch.Tensor) -> LeftSummary:
        found = self._get(("a", key))
        if not isinstance(found, LeftSummary):
            found = self._put(("a", key), summarize_left(a3))
        return found

    def right(
        self, key: Hashable, b3: torch.Tensor, plan: CheckPlan, generator: torch.Generator
    ) -> RightSummary:
        full_key = ("b", key, plan.chunks, plan.vectors)
        found = self._get(full_key)
        if not isinstance(found, RightSummary):
            found = self._put(full_key, summarize_right(b3, plan, generator))
        return found

    def reference(
        self, a_key: Hashable, b_key: Hashable, right: RightSummary
    ) -> torch.Tensor | None:
        """The kept reference of the tile of these blocks, made with ``right``'s ρ; None
        where there is none, or it was made with a ρ since let go."""
        found = self._get(("ref", a_key, b_key))
        if isinstance(found, KeptReference) and found.right is right:
            return found.values
        return None

    def keep_reference(
        self, a_key: Hashable, b_key: Hashable, right: RightSummary, values: torch.Tensor
    ) -> None:
        # Replaces one made with a ρ since let go.
        self._put(("ref", a_key, b_key), KeptReference(right, values), replace=True)

    def __len__(self) -> int:
        return len(self._entries)

    def _get(self, key: Hashable) -> LeftSummary | RightSummary | KeptReference | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def _put(self, key: Hashable, summary: _Summary, *, replace: bool = False) -> _Summary:
        with self._lock:
            if replace and key in self._entries:
                self._bytes -= _nbytes(self._entries.pop(key))
            if key not in self._entries:
                self._entries[key] = summary
                self._bytes += _nbytes(summary)
            while self._bytes > self.budget_bytes and len(self._entries) > 1:
                self._bytes -= _nbytes(self._entries.popitem(last=False)[1])
        return summary


def _nbytes(summary: LeftSummary | RightSummary | KeptReference) -> int:
    tensors = [getattr(summary, name) for name in summary.__dataclass_fields__]
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
