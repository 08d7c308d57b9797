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

Every matrix is read at memory speed with no float64 copy: ``a`` and ``b`` twice each,
``c`` once for ``c ρ`` and once more for its row norms only where the tile does not pass
without them (``_excess``). Only rows whose fp32 norms underflow (entries below about
1e-19) are read once more, in float64 (``chunk_norms64``). What depends only on an
operand block (row norms, ``b ρ`` and the ρ it used) can be kept in a ``CheckCache`` and
shared by every tile that block takes part in.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from coordinator.tiles import row_products
from coordinator.tiles.check_parts import (
    RHO_SQ,
    CheckCache,
    CheckPlan,
    LeftSummary,
    RightSummary,
    as_float64,
    chunk_norms64,
    rows_times_each,
    summarize_left,
    summarize_right,
    times_skinny,
)
from coordinator.tiles.honest_error import (
    ORDER_MARGIN,
    UNIT_ROUNDOFF,
    EntryRounding,
    accumulation_dtype,
    subnormal_spacing,
    threshold,
)


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


def check_product(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    generator: torch.Generator,
    *,
    cache: CheckCache | None = None,
    blocks: tuple[Hashable, Hashable] | None = None,
    partners: Callable[[], Sequence[Partner]] | None = None,
    exact_margin: bool = False,
) -> CheckResult:
    """Is ``c`` an honest ``a @ b`` (2-D) or ``torch.bmm(a, b)`` (3-D)?

    With a ``cache`` and the operands' content ids (``blocks``), what depends only on
    ``a`` or only on ``b`` is taken from (or left in) the cache. ``partners`` says, when
    asked (only where this tile's reference is not kept yet), the other ``b`` blocks
    (content id, operand) whose tiles with this ``a`` are still to be checked, as the
    rest of a row of a GEMM's grid: their references ``a (b ρ)`` are made in the same
    read of ``a`` as this one's and kept in the cache for their tiles.

    A passing tile's ``margin`` is an upper bound where the check could stop before
    reading ``c``'s norms (``_excess``); ``exact_margin`` always reads them, for the
    calibration, which reports how close honest rounding comes to the threshold.
    """
    verdict = _without_arithmetic(a, b, c)
    if verdict is not None:
        return verdict
    work = accumulation_dtype(a.dtype)
    bound_first = work == a.dtype and not exact_margin
    verdict = _check(a, b, c, work, generator, cache, blocks, partners, bound_first)
    if verdict is not None:
        return verdict
    # Something was not finite. Only a step that has already blown up (inf/NaN
    # operands) has honest non-finite products; such a tile cannot be checked, and it
    # does not matter. Finite operands whose sums leave fp32's range are checked again
    # in float64, and so are results with entries an honest kernel rounds past their
    # dtype's range (a model blowing up in fp16): those entries are made exact first.
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return CheckResult(True, 0.0)
    if not bool(torch.isfinite(c).all()):
        exact = _overflows_made_exact(a, b, c, generator)
        if exact is None:
            return CheckResult(False, math.inf, reason=CheckReason.NON_FINITE)
        c = exact
    elif work == torch.float64:
        return CheckResult(False, math.inf, reason=CheckReason.NON_FINITE)
    verdict = _check(a, b, c, torch.float64, generator, None, None, None, False)
    return verdict or CheckResult(False, math.inf, reason=CheckReason.NON_FINITE)


# Non-finite entries of a result looked at first, one by one, before the whole
# product is made in float64.
OVERFLOW_SAMPLE = 16


def _overflows_made_exact(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, generator: torch.Generator
) -> torch.Tensor | None:
    """``c`` in float64 with its non-finite entries replaced by their exact values, if
    an honest kernel could have returned each of them (``_honest_non_finite``); None if
    one could not. A few of them, drawn at random, are asked first, one row's work each,
    so that infinities where no honest sum overflows are refused without a product in
    float64."""
    bad = ~torch.isfinite(c)
    where = bad.nonzero()
    drawn = where[torch.randperm(len(where), generator=generator)[:OVERFLOW_SAMPLE]]
    if c.dim() == 2:
        rows, cols = drawn.unbind(1)
        a_rows, b_cols = a[rows].double(), b[:, cols].mT.double()
    else:
        tiles, rows, cols = drawn.unbind(1)
        a_rows, b_cols = a[tiles, rows].double(), b[tiles, :, cols].double()
    terms = a_rows * b_cols  # [drawn, k]
    found = c[tuple(drawn.unbind(1))]
    k = a.shape[-1]
    if not bool(_honest_non_finite(found, terms.sum(-1), terms.abs().sum(-1), k).all()):
        return None
    a64, b64 = a.double(), b.double()
    exact = torch.matmul(a64, b64)
    budget = torch.matmul(a64.abs(), b64.abs())
    if not bool(_honest_non_finite(c[bad], exact[bad], budget[bad], k).all()):
        return None
    return torch.where(bad, exact, c.double())


def _honest_non_finite(
    found: torch.Tensor, exact: torch.Tensor, budget: torch.Tensor, k: int
) -> torch.Tensor:
    """Per non-finite entry ``found`` of a result of ``found``'s dtype, with the exact
    value of its sum and the sum of its terms' magnitudes: could an honest kernel have
    returned it?

    An honest kernel's sum is the exact one give or take what its accumulation rounds
    (at most ``k`` unit roundoffs of the magnitudes summed). It rounds to +inf only if
    that can reach the dtype's largest value, to -inf likewise below, and to anything
    (NaN included: inf - inf) only where the accumulator itself could overflow."""
    acc = accumulation_dtype(found.dtype)
    slack = budget * (1.01 * k * UNIT_ROUNDOFF[acc] + UNIT_ROUNDOFF[torch.float64])
    top = torch.finfo(found.dtype).max
    wild = budget + slack >= torch.finfo(acc).max
    up = (found == math.inf) & (exact + slack >= top)
    down = (found == -math.inf) & (exact - slack <= -top)
    return wild | up | down


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
    partners: Callable[[], Sequence[Partner]] | None,
    bound_first: bool,
) -> CheckResult | None:
    """The check in arithmetic of ``work``; None where a value on its way is not finite."""
    # No copies for fp32 and fp64 tiles.
    a3, b3, c3 = (_batched(t, work) for t in (a, b, c))
    batch, m, n = c3.shape
    plan = CheckPlan.for_shape(batch, m, a.shape[-1], n)
    reference: torch.Tensor | None = None
    if cache is not None and blocks is not None:
        # b first: a is read again by its reference right after its norms, while cached.
        right = cache.right(blocks[1], b3, plan, generator)
        left = cache.left(blocks[0], a3)
        reference = cache.reference(blocks[0], blocks[1], right)
        if reference is None and partners is not None:
            reference = _row_references(
                a3, b3.shape, blocks, right, partners(), plan, generator, cache
            )
    else:
        right = summarize_right(b3, plan, generator)
        left = summarize_left(a3)
    (worst,) = _statistics(a3, c3, left, right, plan, a.dtype, 1, bound_first, reference)
    return None if worst is None else _verdict(worst, plan)


def _statistics(
    a3: torch.Tensor,
    c3: torch.Tensor,
    left: LeftSummary,
    right: RightSummary,
    plan: CheckPlan,
    dtype: torch.dtype,
    tiles: int,
    bound_first: bool,
    reference: torch.Tensor | None = None,
) -> list[float | None]:
    """Each of the ``tiles`` tiles stacked in ``c3``: its largest squared statistic in
    units of its honest variance (``_excess``). ``reference``: ``a (b ρ)`` where it was
    made ahead (``_row_references``)."""
    if reference is None:  # before c's pass: a is still cached from its norms
        reference = _reference(a3, right.projected, plan)
    claimed = _claimed([c3], right.vectors, plan)
    return _excess(
        claimed.sub_(reference.reshape(claimed.shape)).square_(),
        _honest_variance(a3, left, right, plan, dtype),
        lambda: _c_norms(c3, plan),
        tiles,
        plan,
        bound_first,
    )


def _excess(
    deviation: torch.Tensor,
    variance: tuple[torch.Tensor, float],
    c_norms: Callable[[], torch.Tensor],
    tiles: int,
    plan: CheckPlan,
    bound_first: bool,
) -> list[float | None]:
    """Each tile's largest squared deviation ``(c ρ - a (b ρ))²`` over its honest
    variance; None for a tile whose variance is not finite (a norm left the range of the
    work dtype), NaN or inf where ``c``, ``a`` or ``b`` is not.

    The variance grows with the squared norms of ``c``'s row chunks. ``bound_first``
    tries it without them first: a tile that passes so passes with them too, and a pass
    over ``c`` is saved. Half-precision tiles round their result, an error as large as
    ``c`` itself, so they would not pass without them: callers pass ``bound_first``
    only where the tiles' dtype is the work dtype. Where any tile does not pass so,
    every verdict is taken with them, as without the bound."""
    without_c, c_coefficient = variance
    if bound_first:
        worst = (deviation / without_c).reshape(tiles, -1).amax(dim=1)
        finite = without_c.reshape(tiles, -1).amax(dim=1).isfinite()
        limit = threshold(plan.statistics)
        if bool((finite & (worst <= limit * limit)).all()):
            return worst.tolist()
    whole = without_c.add_(c_norms().unsqueeze(-1), alpha=c_coefficient)
    worst_list = deviation.div_(whole).reshape(tiles, -1).amax(dim=1).tolist()
    finite_list = whole.reshape(tiles, -1).amax(dim=1).isfinite().tolist()
    return [w if ok else None for w, ok in zip(worst_list, finite_list, strict=True)]


# A type for check_product's partners: a b block's content id and the operand.
Partner = tuple[Hashable, torch.Tensor]
# Partners whose references one read of a makes at most: each adds a column per chunk
# and vector to the product, so a long row is taken in parts.
MAX_PARTNERS = 15


def _row_references(
    a3: torch.Tensor,
    b_shape: torch.Size,
    blocks: tuple[Hashable, Hashable],
    right: RightSummary,
    partners: Sequence[Partner],
    plan: CheckPlan,
    generator: torch.Generator,
    cache: CheckCache,
) -> torch.Tensor:
    """This tile's reference ``a (b ρ)``, made in one read of ``a`` with those of its
    partners of the same shape that have none kept yet; theirs go into ``cache``.

    Each reference is the one its tile alone would make with its ``b``'s ρ, in the same
    chains (the columns of one product are independent sums, as in ``_cross_reference``),
    and a kept one serves its tile only while the cache still hands out that ρ."""
    others: list[tuple[Hashable, RightSummary]] = []
    for key, b in partners:
        if len(others) == MAX_PARTNERS:
            break
        b3 = _batched(b, a3.dtype)
        if key == blocks[1] or b3.shape != b_shape:
            continue
        theirs = cache.right(key, b3, plan, generator)
        if cache.reference(blocks[0], key, theirs) is None:
            others.append((key, theirs))
    if not others:
        return _reference(a3, right.projected, plan)
    summaries = [right, *(theirs for _, theirs in others)]
    projected = torch.cat([summary.projected for summary in summaries])
    joint = _cross_reference([a3], projected, plan, len(summaries))[0]
    rows = joint.unflatten(-1, (len(summaries), -1))  # [batch, m, B, chunks * V]
    for j, (key, theirs) in enumerate(others, start=1):
        cache.keep_reference(blocks[0], key, theirs, rows[..., j, :].contiguous())
    return rows[..., 0, :]


def _claimed(
    results: Sequence[torch.Tensor], vectors: torch.Tensor, plan: CheckPlan
) -> torch.Tensor:
    """``c ρ`` of each of ``results`` (one shape, ``[batch, m, n]``) in float64, joined
    along the batch: ``[tiles * batch, m, chunks, V]``."""
    m = results[0].shape[1]
    return as_float64(rows_times_each(results, plan.width, vectors)).view(
        -1, m, plan.chunks, plan.vectors
    )


def _c_norms(c3: torch.Tensor, plan: CheckPlan) -> torch.Tensor:
    """The squared norms of c's row chunks, ``[batch, m, chunks]`` float64."""
    return chunk_norms64(c3, plan.chunks, plan.width).square_()


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
    partners: Sequence[Callable[[], Sequence[Partner]] | None] | None = None,
) -> list[CheckResult]:
    """``check_product`` of many ``(a, b, c)`` tiles, with the same verdicts in a few
    torch calls for all of them instead of a few dozen for each.

    Tiles of one shape and dtype up to ``STACK_MAX_MACS`` are checked together, where a
    check's few dozen calls cost as much as its passes over the tile; larger ones one at
    a time, with the summaries their blocks left in ``cache``. Each keeps its own plan
    (that of its shape alone), statistics, unevenness and threshold, so its verdict is the one a
    check of it alone would give with the same check vectors; the tiles of a stack share
    those vectors, which is as sound as fresh ones for each: workers never see them. A
    tile alone in its shape, one that is malformed or empty, and one whose statistics
    are not finite are checked on their own (``cache``, ``blocks`` and ``partners`` as
    for ``check_product``).
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
            *tiles[i],
            generator,
            cache=cache,
            blocks=blocks[i] if blocks is not None else None,
            partners=partners[i] if partners is not None else None,
        )
        for i, verdict in enumerate(verdicts)
    ]


# Tiles of at most this many multiply-adds are checked in stacks (check_products): up to
# there a stack's fewer calls gain more than the operand summaries a stack does not
# take from the cache cost (bench/bench_verify.py).
STACK_MAX_MACS = 512**3
# Results and operand blocks at least this large are summarised one by one, read where
# they lie: stacking them would copy each once more, and a call's fixed cost is small
# next to a pass over them. Below it the copy costs less than the calls it saves.
STACK_C_BELOW = 1 << 15


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
    every distinct ``b``), as in a grid the tiles of a row block share their ``a``. The
    large blocks are read where they lie, one call each, not copied into a stack; small
    blocks and results are (``STACK_C_BELOW``)."""
    a0, _, c0 = tiles[0]
    count = len(tiles)
    work = accumulation_dtype(a0.dtype)
    tile_batch = 1 if a0.dim() == 2 else a0.shape[0]
    plan = CheckPlan.for_shape(tile_batch, c0.shape[-2], a0.shape[-1], c0.shape[-1])
    a_blocks, a_index = _distinct([t[0] for t in tiles], [k[0] if k else None for k in keys])
    b_blocks, b_index = _distinct([t[1] for t in tiles], [k[1] if k else None for k in keys])
    if len(a_blocks) * len(b_blocks) > 2 * count:
        # Few tiles share their blocks: the products of every a against every b would
        # cost more than pairing the operands tile by tile.
        return _check_stack_copied(tiles, generator)
    a_work = _for_summaries(a_blocks, work)
    b_work = _for_summaries(b_blocks, work)
    right = summarize_right(
        b_work[0] if len(b_work) == 1 else b_work, plan, generator, tiles=len(b_blocks)
    )
    if right.uneven_row_sq is not None:
        # The exact sums of terms pair each a with its b: that rare case stacks the
        # operands tile by tile.
        return _check_stack_copied(tiles, generator)
    left = summarize_left(a_work)
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
    reference = _cross_reference(a_work, right.projected, plan, len(b_blocks))
    # [A, tile_batch, m, B, cv] -> [count, tile_batch, m, cv]
    reference = reference.reshape(len(a_blocks), tile_batch, m, len(b_blocks), cv)[a_at, :, :, b_at]
    if c0.numel() < STACK_C_BELOW:
        results = [_joined([t[2] for t in tiles], work)]
    else:
        results = [_batched(t[2], work) for t in tiles]
    claimed = _claimed(results, right.vectors, plan)
    worst = _excess(
        claimed.sub_(reference.reshape(claimed.shape)).square_(),
        _honest_variance(a_work[0], tile_left, tile_right, plan, a0.dtype),
        lambda: torch.cat([_c_norms(c3, plan) for c3 in results]),
        count,
        plan,
        work == a0.dtype,
    )
    return [None if w is None else _verdict(w, plan) for w in worst]


def _for_summaries(blocks: list[torch.Tensor], work: torch.dtype) -> list[torch.Tensor]:
    """Distinct operand blocks as the summaries take them, in ``work``: small ones joined
    along one batch dimension, larger ones each where it lies (``STACK_C_BELOW``)."""
    if len(blocks) > 1 and blocks[0].numel() < STACK_C_BELOW:
        return [_joined(blocks, work)]
    return [_batched(block, work) for block in blocks]  # each [tile_batch, m, k]


def _batched(operand: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """One operand with a batch dimension, in ``work``: no copy for fp32 and fp64."""
    batched = operand if operand.dim() == 3 else operand.unsqueeze(0)
    return batched if batched.dtype == work else batched.to(work)


def _joined(operands: list[torch.Tensor], work: torch.dtype) -> torch.Tensor:
    """Operands of one shape along one batch dimension, in ``work``."""
    joined = (torch.stack if operands[0].dim() == 2 else torch.cat)(operands)
    return joined if joined.dtype == work else joined.to(work)


def _cross_reference(
    a_work: list[torch.Tensor], projected: torch.Tensor, plan: CheckPlan, b_count: int
) -> torch.Tensor:
    """``a (b ρ)`` in float64 for every distinct ``a`` against every distinct ``b``,
    ``[A, batch, m, B * chunks * V]``: each ``a`` read once, in the same chains as
    ``_reference`` (the columns of one product are independent sums). ``a_work``: the
    blocks one by one, or joined into one (``_for_summaries``)."""
    _, m, k = a_work[0].shape
    tile_batch = projected.shape[0] // b_count
    # [B * tile_batch, k, cv] -> [tile_batch, k, B * cv]: a small copy of b ρ.
    across = projected.view(b_count, tile_batch, k, -1).permute(1, 2, 0, 3)
    across = across.reshape(tile_batch, k, -1)
    if len(a_work) == 1:
        return _reference(a_work[0].view(-1, tile_batch, m, k), across, plan)
    return torch.stack([_reference(a, across, plan) for a in a_work])


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
    worst = _statistics(a3, c3, left, right, plan, a0.dtype, count, work == a0.dtype)
    return [None if w is None else _verdict(w, plan) for w in worst]


def _reference(a3: torch.Tensor, projected: torch.Tensor, plan: CheckPlan) -> torch.Tensor:
    """``a (b ρ)`` in float64, ``[..., batch, m, chunks * V]`` (``a3`` may have a leading
    dim of its own): one fp32 product, or partial products over K blocks (short chains)
    added in float64. numba's loop where it has it (``row_products``), for every ``a``
    that lies in order; one that lies transposed takes torch's product (joined into a
    stack, a small one lies in order: its margins there may differ in the last bits)."""
    compiled = row_products.kernels()
    if compiled is not None:
        made = compiled.reference(a3, projected, plan.k_blocks)
        if made is not None:
            return made
    if plan.k_blocks == 1:
        return as_float64(times_skinny(a3, projected))
    k = a3.shape[-1]
    block = k // plan.k_blocks
    total: torch.Tensor | None = None
    for start in range(0, k, block):
        # A column slice of a is a strided view that the product reads in place.
        partial = times_skinny(a3[..., start : start + block], projected[:, start : start + block])
        total = as_float64(partial) if total is None else total.add_(partial)
    assert total is not None
    return total


def _terms(a3: torch.Tensor, left: LeftSummary, right: RightSummary) -> torch.Tensor:
    """``Σ_l (a_il b_lj)²`` over each row chunk, ``[batch, m, chunks]``: the bound from
    the largest row of ``b``, or the exact sum where ``b`` is uneven (per tile)."""
    if right.uneven_row_sq is None:
        return left.row_sq.unsqueeze(-1) * right.largest_row_sq.unsqueeze(1)
    # A copy even of a float64 operand: squared in place.
    exact = a3.to(torch.float64, copy=True).square_() @ right.uneven_row_sq
    if right.uneven_tiles is None:
        return exact
    bound = left.row_sq.unsqueeze(-1) * right.largest_row_sq.unsqueeze(1)
    per_tile = a3.shape[0] // right.uneven_tiles.numel()
    uneven = right.uneven_tiles.repeat_interleave(per_tile).view(-1, 1, 1)
    return torch.where(uneven, exact, bound)


def _honest_variance(
    a3: torch.Tensor,
    left: LeftSummary,
    right: RightSummary,
    plan: CheckPlan,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, float]:
    """Variance of each statistic for an honest ``c``: the worker's rounding plus the
    check's own, both linear in two sums per row chunk. Returned as the part without
    ``c``, ``[batch, m, chunks, 1]``, and the coefficient of the squared norm of ``c``'s
    row chunk that adds the rest.

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
    return terms.mul_(rho_sq * on_terms).add_(rho_sq * floor).unsqueeze(-1), rho_sq * on_c
