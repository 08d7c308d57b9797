"""Freivalds' check of a returned tile: is ``c`` the product ``a @ b`` up to honest rounding?

For secret vectors ρ, ``c ρ`` and ``a (b ρ)`` cost O(mk + kn + mn) instead of the
O(mkn) of the GEMM. The check makes one statistic per output row (on large tiles, per
row and column chunk) and vector: ``d = c[i, chunk] ρ - a_i (b[:, chunk] ρ)``. Each is
compared with a threshold from ``coordinator.tiles.honest_error``: a model of the rounding
any honest kernel makes, built from row norms of ``a``, ``b`` and ``c``, set so that an
honest tile is rejected with probability below 1e-9.

At least four vectors: rows are independent looks at a dense error only where the rows
of c differ, and vectors always are. (Nor are rows pooled into one statistic: rows
that repeat, as padding tokens do, round identically, not independently.) On large
tiles (K x N above ``SPLIT_ABOVE``) one wrong entry would hide in the honest noise of a
whole row, which grows with K and with the entries it sums: there rows are cut into
column chunks, as far as the reference ``a (b ρ)`` stays at one column per chunk and
vector and one per 128 columns of the tile (about the cost of a second pass over
``a``), and the check's own fp32 chains are kept short so that their rounding stays
small next to the worker's: ``c ρ`` and ``b ρ`` sum one chunk, ``a (b ρ)`` is summed in
blocks of K whose partial sums are added in float64. Smaller tiles have margin to spare
and take the plain products.

Every matrix is read at memory speed with no float64 copy: ``c`` twice (``c ρ`` and its
row norms), ``a`` and ``b`` twice each. What depends only on an operand block (row
norms, ``b ρ`` and the ρ it used) can be kept in a ``CheckCache`` and shared by every
tile that block takes part in.
"""

from __future__ import annotations

import enum
import math
import secrets
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

import torch

from coordinator.tiles.honest_error import (
    ORDER_MARGIN,
    UNIT_ROUNDOFF,
    EntryRounding,
    accumulation_dtype,
    subnormal_spacing,
    threshold,
)

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


def _float64(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64, laid out in order (``times_skinny`` answers a transposed view)."""
    return t.to(torch.float64, memory_format=torch.contiguous_format)


def _rows_times(x: torch.Tensor, width: int, v: torch.Tensor) -> torch.Tensor:
    """``x`` cut into rows of ``width`` (its last dim a whole number of them), each times
    ``v [width, V]``: ``[rows, V]`` for every row of every chunk, one product."""
    return times_skinny(x.reshape(-1, width), v)


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


class CheckReason(str, enum.Enum):
    """Why a tile failed its check (in the worker's error message and the logs)."""

    SHAPE = "shape"  # the result's shape is not the product's
    DTYPE = "dtype"  # a dtype the tile was not sent in, or one the check does not know
    NON_FINITE = "non-finite"  # inf/NaN from finite operands, in float64 too
    MISMATCH = "mismatch"  # farther from the product than rounding can explain

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CheckResult:
    """The verdict on one tile. ``margin`` is the largest statistic over its threshold:
    at most 1 passes, and honest products stay far below it (the calibration reports
    how far)."""

    ok: bool
    margin: float
    statistics: int = 0
    reason: CheckReason | None = None  # why a tile failed


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


def summarize_left(a3: torch.Tensor) -> LeftSummary:
    return LeftSummary(torch.linalg.vector_norm(a3, dim=-1).to(torch.float64).square_())


def summarize_right(
    b3: torch.Tensor, plan: CheckPlan, generator: torch.Generator, tiles: int = 1
) -> RightSummary:
    """``tiles``: how many tiles ``b3`` stacks (each ``batch / tiles`` of its batches),
    each uneven or not on its own."""
    batch, k, _ = b3.shape
    rho = check_vectors(plan.width, plan.vectors, b3.dtype, generator)
    b4 = b3.reshape(batch, k, plan.chunks, plan.width)
    # Chains of a chunk: [batch, k, chunks * V].
    projected = _rows_times(b3, plan.width, rho).reshape(batch, k, plan.chunks * plan.vectors)
    norms = torch.linalg.vector_norm(b4, dim=-1)  # [batch, k, chunks]
    largest = norms.amax(dim=1)
    # The mean square over l is the norm of the norms over sqrt(k).
    spread = largest > math.sqrt(UNEVEN / k) * torch.linalg.vector_norm(norms, dim=1)
    uneven = spread.view(tiles, -1).any(dim=1)  # [tiles]
    count = int(uneven.sum())
    row_sq = norms.to(torch.float64).square_() if count else None
    mixed = uneven if 0 < count < tiles else None
    return RightSummary(rho, projected, largest.to(torch.float64).square_(), row_sq, mixed)


_Summary = TypeVar("_Summary", LeftSummary, RightSummary)


class CheckCache:
    """Operand summaries shared by the tiles of one operand block (by its content id),
    so a block's row norms and ``b ρ`` are computed once, not once per tile. Reusing ρ
    across the tiles of a block is as sound as a fresh one: workers never see it.
    Thread-safe; keeps the most recently used summaries within ``budget_bytes``."""

    def __init__(self, budget_bytes: int = 128 << 20) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[Hashable, LeftSummary | RightSummary] = OrderedDict()
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

    def __len__(self) -> int:
        return len(self._entries)

    def _get(self, key: Hashable) -> LeftSummary | RightSummary | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def _put(self, key: Hashable, summary: _Summary) -> _Summary:
        with self._lock:
            if key not in self._entries:
                self._entries[key] = summary
                self._bytes += _nbytes(summary)
            while self._bytes > self.budget_bytes and len(self._entries) > 1:
                self._bytes -= _nbytes(self._entries.popitem(last=False)[1])
        return summary


def _nbytes(summary: LeftSummary | RightSummary) -> int:
    tensors = [getattr(summary, name) for name in summary.__dataclass_fields__]
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def check_product(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    generator: torch.Generator,
    *,
    cache: CheckCache | None = None,
    blocks: tuple[Hashable, Hashable] | None = None,
) -> CheckResult:
    """Is ``c`` an honest ``a @ b`` (2-D) or ``torch.bmm(a, b)`` (3-D)?

    With a ``cache`` and the operands' content ids (``blocks``), what depends only on
    ``a`` or only on ``b`` is taken from (or left in) the cache.
    """
    verdict = _without_arithmetic(a, b, c)
    if verdict is not None:
        return verdict
    work = accumulation_dtype(a.dtype)
    verdict = _check(a, b, c, work, generator, cache, blocks)
    if verdict is not None:
        return verdict
    # Something was not finite. Only a step that has already blown up (inf/NaN
    # operands) has honest non-finite products; such a tile cannot be checked, and it
    # does not matter. Finite operands whose sums leave fp32's range are checked again
    # in float64.
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return CheckResult(True, 0.0)
    if work != torch.float64:
        verdict = _check(a, b, c, torch.float64, generator, None, None)
    return verdict or CheckResult(False, math.inf, reason=CheckReason.NON_FINITE)


def _without_arithmetic(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> CheckResult | None:
    """The verdict on a tile that is malformed or has no sum to check; None for the rest."""
    if c.shape != a.shape[:-1] + b.shape[-1:] or a.dim() not in (2, 3) or a.dim() != b.dim():
        return CheckResult(False, math.inf, reason=CheckReason.SHAPE)
    if c.dtype != a.dtype or b.dtype != a.dtype or a.dtype not in UNIT_ROUNDOFF:
        return CheckResult(False, math.inf, reason=CheckReason.DTYPE)
    if c.numel() == 0:
        return CheckResult(True, 0.0)
    if a.shape[-1] == 0:
        ok = bool((c == 0).all())  # an empty sum is exactly zero
        return CheckResult(ok, 0.0 if ok else math.inf, reason=None if ok else CheckReason.MISMATCH)
    return None


def _check(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    work: torch.dtype,
    generator: torch.Generator,
    cache: CheckCache | None,
    blocks: tuple[Hashable, Hashable] | None,
) -> CheckResult | None:
    """The check in arithmetic of ``work``; None where a value on its way is not finite."""
    # No copies for fp32 and fp64 tiles.
    a3, b3, c3 = (t if t.dtype == work else t.to(work) for t in (a, b, c))
    if a.dim() == 2:
        a3, b3, c3 = a3.unsqueeze(0), b3.unsqueeze(0), c3.unsqueeze(0)
    batch, m, n = c3.shape
    plan = CheckPlan.for_shape(batch, m, a.shape[-1], n)
    if cache is not None and blocks is not None:
        left, right = cache.left(blocks[0], a3), cache.right(blocks[1], b3, plan, generator)
    else:
        left, right = summarize_left(a3), summarize_right(b3, plan, generator)
    variance, excess = _statistics(a3, c3, left, right, plan, a.dtype)
    if not math.isfinite(float(variance.max())):
        return None  # a norm left the range of the work dtype
    return _verdict(float(excess.max()), plan)  # NaN or inf where c, a or b is not finite


def _statistics(
    a3: torch.Tensor,
    c3: torch.Tensor,
    left: LeftSummary,
    right: RightSummary,
    plan: CheckPlan,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each statistic's honest variance and its squared excess over it (in units of the
    variance), ``[batch, m, chunks, 1]`` and ``[batch, m, chunks, V]``."""
    claimed, c_sq = _claimed(c3, right.vectors, plan)
    reference = _reference(a3, right.projected, plan).reshape(claimed.shape)
    variance = _honest_variance(a3, c_sq, left, right, plan, dtype)
    return variance, claimed.sub_(reference).square_().div_(variance)


def _claimed(
    c3: torch.Tensor, vectors: torch.Tensor, plan: CheckPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """``c ρ`` in float64, ``[batch, m, chunks, V]``, and the squared norms of c's row
    chunks, ``[batch, m, chunks]`` float64."""
    batch, m, _ = c3.shape
    c4 = c3.reshape(batch, m, plan.chunks, plan.width)
    claimed = _float64(_rows_times(c3, plan.width, vectors)).view(*c4.shape[:-1], -1)
    return claimed, torch.linalg.vector_norm(c4, dim=-1).to(torch.float64).square_()


def _verdict(worst: float, plan: CheckPlan) -> CheckResult | None:
    """The verdict on a tile's largest squared excess; None where it is not finite."""
    if not math.isfinite(worst):
        return None
    limit = threshold(plan.statistics)
    ok = worst <= limit * limit
    return CheckResult(
        ok, math.sqrt(worst) / limit, plan.statistics, None if ok else CheckReason.MISMATCH
    )


def check_products(
    tiles: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    generator: torch.Generator,
    *,
    cache: CheckCache | None = None,
    blocks: Sequence[tuple[Hashable, Hashable] | None] | None = None,
) -> list[CheckResult]:
    """``check_product`` of many ``(a, b, c)`` tiles, with the same verdicts in a few
    torch calls for all of them instead of a few dozen for each.

    Small tiles of one shape and dtype (``STACK_MAX_MACS``) are checked together,
    where a check's few dozen calls cost more than its passes over the tile; larger
    ones one at a time, where stacking them would only add copies. Each keeps its own plan (that of
    its shape alone), statistics, unevenness and threshold, so its verdict is the one a
    check of it alone would give with the same check vectors; the tiles of a stack share
    those vectors, which is as sound as fresh ones for each: workers never see them. A
    tile alone in its shape, one that is malformed or empty, and one whose statistics
    are not finite are checked on their own (``cache`` and ``blocks`` as for
    ``check_product``).
    """
    verdicts: list[CheckResult | None] = [None] * len(tiles)
    stacks: dict[tuple[torch.Size, torch.Size, torch.dtype], list[int]] = {}
    for i, (a, b, c) in enumerate(tiles):
        if c.numel() * a.shape[-1] <= STACK_MAX_MACS and _without_arithmetic(a, b, c) is None:
            stacks.setdefault((a.shape, b.shape, a.dtype), []).append(i)
    for members in stacks.values():
        if len(members) > 1:
            keys = [blocks[i] if blocks is not None else None for i in members]
            stacked = _check_stack([tiles[i] for i in members], generator, keys)
            for i, verdict in zip(members, stacked, strict=True):
                verdicts[i] = verdict
    return [
        verdict
        or check_product(
            *tiles[i], generator, cache=cache, blocks=blocks[i] if blocks is not None else None
        )
        for i, verdict in enumerate(verdicts)
    ]


# Tiles of at most this many multiply-adds are checked in stacks (check_products).
STACK_MAX_MACS = 128**3
# Results at least this large have c ρ and c's norms taken tile by tile, from the tiles
# as they are: stacking them would copy every result once more, and a call's fixed cost
# is small next to a pass over them.
STACK_C_BELOW = 1 << 18


def _distinct(
    operands: list[torch.Tensor], keys: list[Hashable | None]
) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct operand blocks among ``operands`` and the index of each one's block.

    Blocks are the same where their content ids are (``keys``) or where they are the
    very same memory (a row block shared by the tiles of a grid): equal content either
    way, so a summary of one is the summary of the other."""
    found: dict[Hashable, int] = {}
    distinct: list[torch.Tensor] = []
    index: list[int] = []
    for operand, key in zip(operands, keys, strict=True):
        identity: Hashable = (
            ("id", key)
            if key is not None
            else ("memory", operand.data_ptr(), operand.shape, operand.stride())
        )
        if identity not in found:
            found[identity] = len(distinct)
            distinct.append(operand)
        index.append(found[identity])
    return distinct, index


def _check_stack(
    tiles: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    generator: torch.Generator,
    keys: list[tuple[Hashable, Hashable] | None],
) -> list[CheckResult | None]:
    """Tiles of one shape and dtype, checked together; None for a tile to check alone.

    Each distinct ``a`` and ``b`` block is summarised once, and each distinct ``a`` is
    read once for the references of all its tiles (one product against the ``b ρ`` of
    every distinct ``b``), as in a grid the tiles of a row block share their ``a``."""
    a0, _, c0 = tiles[0]
    count = len(tiles)
    work = accumulation_dtype(a0.dtype)
    tile_batch = 1 if a0.dim() == 2 else a0.shape[0]
    plan = CheckPlan.for_shape(tile_batch, c0.shape[-2], a0.shape[-1], c0.shape[-1])
    a_blocks, a_index = _distinct([t[0] for t in tiles], [k[0] if k else None for k in keys])
    b_blocks, b_index = _distinct([t[1] for t in tiles], [k[1] if k else None for k in keys])
    a3 = _joined(a_blocks, work)  # [A * tile_batch, m, k]
    b3 = _joined(b_blocks, work)  # [B * tile_batch, k, n]
    if len(a_blocks) * len(b_blocks) > 2 * count:
        # Few tiles share their blocks: the products of every a against every b would
        # cost more than pairing the operands tile by tile.
        return _check_stack_copied(tiles, generator)
    right = summarize_right(b3, plan, generator, tiles=len(b_blocks))
    if right.uneven_row_sq is not None:
        # The exact sums of terms pair each a with its b: that rare case stacks the
        # operands tile by tile.
        return _check_stack_copied(tiles, generator)
    left = summarize_left(a3)
    m, cv = c0.shape[-2], plan.chunks * plan.vectors
    a_at = torch.tensor(a_index)
    b_at = torch.tensor(b_index)
    # Per tile: the summaries of its own blocks, [count * tile_batch, ...].
    row_sq = left.row_sq.view(len(a_blocks), tile_batch, m)[a_at].view(-1, m)
    largest = right.largest_row_sq.view(len(b_blocks), tile_batch, -1)[b_at]
    tile_left = LeftSummary(row_sq)
    tile_right = RightSummary(
        right.vectors, right.projected, largest.view(count * tile_batch, -1), None
    )
    reference = _cross_reference(a3, right.projected, plan, len(a_blocks), len(b_blocks))
    # [A, tile_batch, m, B, cv] -> [count, tile_batch, m, cv]
    reference = reference.reshape(len(a_blocks), tile_batch, m, len(b_blocks), cv)[a_at, :, :, b_at]
    if c0.numel() < STACK_C_BELOW:
        claimed, c_sq = _claimed(_joined([t[2] for t in tiles], work), right.vectors, plan)
    else:
        parts = [_claimed(_joined([t[2]], work), right.vectors, plan) for t in tiles]
        claimed = torch.cat([p[0] for p in parts])
        c_sq = torch.cat([p[1] for p in parts])
    variance = _honest_variance(a3, c_sq, tile_left, tile_right, plan, a0.dtype)
    excess = claimed.sub_(reference.reshape(claimed.shape)).square_().div_(variance)
    finite = variance.view(count, -1).amax(dim=1).isfinite().tolist()
    worst = excess.view(count, -1).amax(dim=1).tolist()
    return [_verdict(w, plan) if ok else None for w, ok in zip(worst, finite, strict=True)]


def _joined(operands: list[torch.Tensor], work: torch.dtype) -> torch.Tensor:
    """Operands of one shape along one batch dimension, in ``work``: no copy for one."""
    if len(operands) == 1:
        joined = operands[0] if operands[0].dim() == 3 else operands[0].unsqueeze(0)
    else:
        joined = (torch.stack if operands[0].dim() == 2 else torch.cat)(operands)
    return joined if joined.dtype == work else joined.to(work)


def _cross_reference(
    a3: torch.Tensor, projected: torch.Tensor, plan: CheckPlan, a_count: int, b_count: int
) -> torch.Tensor:
    """``a (b ρ)`` in float64 for every distinct ``a`` against every distinct ``b``,
    ``[A, batch, m, B * chunks * V]``: each ``a`` read once, in the same chains as
    ``_reference`` (the columns of one product are independent sums)."""
    batch_a, m, k = a3.shape
    tile_batch = batch_a // a_count
    a4 = a3.view(a_count, tile_batch, m, k)
    # [B * tile_batch, k, cv] -> [tile_batch, k, B * cv]: a small copy of b ρ.
    across = projected.view(b_count, tile_batch, k, -1).permute(1, 2, 0, 3)
    return _reference(a4, across.reshape(tile_batch, k, -1), plan)


def _check_stack_copied(
    tiles: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], generator: torch.Generator
) -> list[CheckResult | None]:
    """``_check_stack`` with every tile's operands stacked as they come."""
    a0, _, c0 = tiles[0]
    count = len(tiles)
    joined = torch.stack if a0.dim() == 2 else torch.cat  # along a (new) batch dimension
    a3, b3, c3 = (joined([tile[i] for tile in tiles]) for i in range(3))
    work = accumulation_dtype(a0.dtype)
    if work != a0.dtype:
        a3, b3, c3 = a3.to(work), b3.to(work), c3.to(work)
    tile_batch = 1 if a0.dim() == 2 else a0.shape[0]
    plan = CheckPlan.for_shape(tile_batch, c0.shape[-2], a0.shape[-1], c0.shape[-1])
    left = summarize_left(a3)
    right = summarize_right(b3, plan, generator, tiles=count)
    variance, excess = _statistics(a3, c3, left, right, plan, a0.dtype)
    finite = variance.view(count, -1).amax(dim=1).isfinite().tolist()
    worst = excess.view(count, -1).amax(dim=1).tolist()
    return [_verdict(w, plan) if ok else None for w, ok in zip(worst, finite, strict=True)]


def _reference(a3: torch.Tensor, projected: torch.Tensor, plan: CheckPlan) -> torch.Tensor:
    """``a (b ρ)`` in float64, ``[..., batch, m, chunks * V]`` (``a3`` may have a leading
    dim of its own): one fp32 product, or partial products over K blocks (short chains)
    added in float64."""
    if plan.k_blocks == 1:
        return _float64(times_skinny(a3, projected))
    k = a3.shape[-1]
    block = k // plan.k_blocks
    total: torch.Tensor | None = None
    for start in range(0, k, block):
        # A column slice of a is a strided view that the product reads in place.
        partial = times_skinny(a3[..., start : start + block], projected[:, start : start + block])
        total = _float64(partial) if total is None else total.add_(partial)
    assert total is not None
    return total


def _terms(a3: torch.Tensor, left: LeftSummary, right: RightSummary) -> torch.Tensor:
    """``Σ_l (a_il b_lj)²`` over each row chunk, ``[batch, m, chunks]``: the bound from
    the largest row of ``b``, or the exact sum where ``b`` is uneven (per tile)."""
    if right.uneven_row_sq is None:
        return left.row_sq.unsqueeze(-1) * right.largest_row_sq.unsqueeze(1)
    exact = a3.to(torch.float64).square() @ right.uneven_row_sq
    if right.uneven_tiles is None:
        return exact
    bound = left.row_sq.unsqueeze(-1) * right.largest_row_sq.unsqueeze(1)
    per_tile = a3.shape[0] // right.uneven_tiles.numel()
    uneven = right.uneven_tiles.repeat_interleave(per_tile).view(-1, 1, 1)
    return torch.where(uneven, exact, bound)


def _honest_variance(
    a3: torch.Tensor,
    c_sq: torch.Tensor,
    left: LeftSummary,
    right: RightSummary,
    plan: CheckPlan,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Variance of each statistic for an honest ``c``, ``[batch, m, chunks, 1]``: the
    worker's rounding plus the check's own, both linear in two sums per row chunk.

    ``Σ_j Σ_l (a_il b_lj)²`` over a chunk is bounded by ``||a_i||² max_l ||b_l,chunk||²``,
    or summed exactly (a pass over a squared copy of ``a``) where ``b``'s rows are so
    uneven that the bound would be loose. The check's own chains, as expectations over
    the random signs of ρ: ``c ρ`` and ``b ρ`` are walks over a chunk, whose ``Σ_t S_t²``
    is at most the chunk's width times the sum of the squared terms in any order;
    ``a (b ρ)`` restarts at every K block, and each block is an honest partial sum of its
    own: the worker's model over the block, whose end points share c (drift) and the
    terms' spread (walk).
    """
    k = a3.shape[-1]
    u2 = UNIT_ROUNDOFF[a3.dtype] ** 2 / 3.0
    rho_sq = RHO_SQ
    terms = _terms(a3, left, right)
    rounding = EntryRounding.of(dtype)
    width, block = plan.width, k // plan.k_blocks
    share = block / k  # a block's share of K
    own_walk = u2 * (width + 1)  # c ρ on c's sum; b ρ, carried through ||a_i||², on the terms
    on_c = rounding.c_coefficient(k) + own_walk + u2 * ORDER_MARGIN * block * share / 3.0
    on_terms = (
        rounding.terms_coefficient(k)
        + own_walk
        + u2 * (ORDER_MARGIN * block * ((1.0 - share) / 3.0 + 1.0 / 6.0) + 1.0)
    )
    # The worker's steps on subnormals, and the reference's own k steps.
    floor = (
        width * rounding.absolute_per_entry(k) + (k + 1) * subnormal_spacing(a3.dtype) ** 2 / 12.0
    )
    variance = c_sq.mul_(rho_sq * on_c).add_(terms, alpha=rho_sq * on_terms).add_(rho_sq * floor)
    return variance.unsqueeze(-1)
