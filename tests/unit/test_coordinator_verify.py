"""Freivalds' check of returned tiles (coordinator.tiles.verify).

Honest products must pass for every wire dtype, mm and bmm, across shapes up to K=8192
and large magnitudes; wrong products (one element off, transposed, shuffled, NaN, zeros,
wrong shape or dtype) must fail. Then how the check cuts tiles, its threshold, its cache
of operand summaries and magnitudes beyond fp32's range. Every call gets its own seeded
generator, so each case is deterministic. The detection floor and the honest kernels
are in test_result_check_floor.py.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable

import pytest
import torch

from coordinator.tiles.check_parts import (
    CheckCache,
    CheckPlan,
    RightSummary,
    new_generator,
    summarize_right,
)
from coordinator.tiles.honest_error import threshold
from coordinator.tiles.verify import CheckReason, check_product, check_products

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Largest |value| used per dtype: fp16 overflows at 65504, so its products stay small.
MAGNITUDES = {
    torch.float32: (1e-3, 1.0, 1e3),
    torch.float64: (1e-3, 1.0, 1e3),
    torch.bfloat16: (1e-3, 1.0, 1e3),
    torch.float16: (0.1, 1.0),  # smaller values make subnormal products: see the xfail
}
SHAPES = (  # (batch or None, m, k, n)
    (None, 1, 1, 1),
    (None, 3, 7, 5),
    (None, 64, 64, 64),
    (None, 200, 3, 300),
    (None, 17, 8192, 9),
    (None, 1, 8192, 1),
    (None, 96, 2048, 40),
    (2, 1, 1, 1),
    (3, 16, 33, 8),
    (4, 64, 64, 64),
    (2, 12, 8192, 6),
)


def freivalds_ok(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, generator: torch.Generator
) -> bool:
    return check_product(a, b, c, generator).ok


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def operands(
    batch: int | None, m: int, k: int, n: int, dtype: torch.dtype, scale: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(seed)
    lead = () if batch is None else (batch,)
    a = torch.randn(*lead, m, k, generator=g, dtype=torch.float64) * scale
    b = torch.randn(*lead, k, n, generator=g, dtype=torch.float64) * scale
    return a.to(dtype), b.to(dtype)


def honest(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What a worker returns: torch.matmul / torch.bmm in the tile's dtype."""
    return torch.matmul(a, b) if a.dim() == 2 else torch.bmm(a, b)


def fits_fp16(k: int, scale: float) -> bool:
    # |c| ~ k * scale^2 in the worst case: keep honest fp16 products finite.
    return k * scale * scale * 8 < 65504


def honest_cases() -> list[tuple[torch.dtype, tuple[int | None, int, int, int], float]]:
    cases = []
    for dtype in DTYPES:
        for shape in SHAPES:
            for scale in MAGNITUDES[dtype]:
                if dtype == torch.float16 and not fits_fp16(shape[2], scale):
                    continue
                cases.append((dtype, shape, scale))
    return cases


def test_honest_products_pass_for_every_dtype_op_and_shape() -> None:
    cases = honest_cases()
    failures = []
    for i, (dtype, (batch, m, k, n), scale) in enumerate(cases):
        for repeat in range(2):  # two operand draws and two check vectors per case
            seed = 1000 * i + repeat
            a, b = operands(batch, m, k, n, dtype, scale, seed)
            if not freivalds_ok(a, b, honest(a, b), gen(seed + 7)):
                failures.append((dtype, (batch, m, k, n), scale, seed))
    assert len(cases) * 2 >= 190
    assert not failures, failures


def test_honest_products_pass_with_random_shapes_and_offsets() -> None:
    # Non-zero means and mixed signs: cancellation makes |a @ b| far smaller than |a||b|.
    rng = random.Random(5)
    for case in range(60):
        dtype = rng.choice(DTYPES)
        batch = rng.choice([None, rng.randint(1, 4)])
        m, n = rng.randint(1, 48), rng.randint(1, 48)
        k = rng.choice([1, 2, 5, 31, 64, 257, 1024, 4096])
        scale = 1.0 if dtype == torch.float16 and k > 1024 else rng.choice([0.5, 1.0, 4.0])
        if dtype == torch.float16 and not fits_fp16(k, scale + 1.0):
            scale = 0.5
        a, b = operands(batch, m, k, n, torch.float64, scale, 50_000 + case)
        a, b = (a + rng.uniform(-1, 1)).to(dtype), (b + rng.uniform(-1, 1)).to(dtype)
        assert freivalds_ok(a, b, honest(a, b), gen(case)), (dtype, batch, m, k, n)


def test_honest_product_passes_with_a_private_unpredictable_generator() -> None:
    a, b = operands(None, 32, 256, 16, torch.float32, 1.0, 3)
    first, second = new_generator(), new_generator()
    assert freivalds_ok(a, b, honest(a, b), first)
    assert not torch.equal(torch.randn(4, generator=first), torch.randn(4, generator=second))


def test_empty_product_passes_and_accumulated_product_in_fp64_passes() -> None:
    a, b = torch.zeros(0, 4), torch.zeros(4, 3)
    assert freivalds_ok(a, b, torch.zeros(0, 3), new_generator())
    # The coordinator's own fp64 reference of an fp32 tile, rounded back: still honest.
    a, b = operands(None, 40, 3000, 20, torch.float32, 10.0, 4)
    c = (a.double() @ b.double()).float()
    assert freivalds_ok(a, b, c, gen(1))


# ---- wrong products fail ----------------------------------------------------------------

TAMPER_SHAPES = (
    (None, 8, 16, 8),
    (None, 64, 64, 64),
    (None, 33, 1024, 17),
    (None, 17, 8192, 9),
    (3, 16, 64, 16),
    (2, 12, 8192, 6),
)


def row_magnitude(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sum over a row of C of |A||B|: the size of everything that row's values are made of."""
    return (a.double().abs() @ b.double().abs()).sum(-1)


def with_one_element_changed(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, fraction: float, seed: int
) -> torch.Tensor:
    rng = random.Random(seed)
    index = tuple(rng.randrange(size) for size in c.shape)
    bad = c.clone()
    delta = fraction * float(row_magnitude(a, b)[index[:-1]])
    bad[index] = float(bad[index]) + rng.choice([-1, 1]) * delta
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_element_off_by_one_percent_of_its_row_fails(dtype: torch.dtype) -> None:
    for i, (batch, m, k, n) in enumerate(TAMPER_SHAPES):
        for scale in (1.0, 1e3):
            for repeat in range(3):
                seed = 100 * i + 10 * repeat + int(scale > 1)
                a, b = operands(batch, m, k, n, dtype, scale, seed)
                bad = with_one_element_changed(a, b, honest(a, b), 0.01, seed)
                assert not freivalds_ok(a, b, bad, gen(seed)), (batch, m, k, n, scale, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_transposed_shuffled_scaled_or_zero_products_fail(dtype: torch.dtype) -> None:
    for i, (batch, m, k, n) in enumerate(TAMPER_SHAPES + ((None, 48, 48, 48), (2, 20, 8, 20))):
        a, b = operands(batch, m, k, n, dtype, 1.0, 700 + i)
        c = honest(a, b)
        wrong = {
            "zeros": torch.zeros_like(c),
            "rows shuffled": c[..., torch.randperm(m, generator=gen(i)), :],
            "columns shuffled": c[..., torch.randperm(n, generator=gen(i)).flip(0)],
            "off by 1%": c * 1.01,
            "product of other operands": honest(*operands(batch, m, k, n, dtype, 1.0, 900 + i)),
        }
        if m == n:
            wrong["transposed"] = c.transpose(-1, -2).contiguous()
        for what, bad in wrong.items():
            if torch.equal(bad, c):  # a 1-row shuffle or a tiny tile can change nothing
                continue
            assert not freivalds_ok(a, b, bad, gen(i)), (what, batch, m, k, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_non_finite_value_injected_into_an_honest_product_fails(
    dtype: torch.dtype, poison: float
) -> None:
    for batch, m, k, n in ((None, 8, 32, 8), (3, 5, 64, 7)):
        a, b = operands(batch, m, k, n, dtype, 1.0, 11)
        bad = honest(a, b).clone()
        bad[(0,) * bad.dim()] = poison
        assert not freivalds_ok(a, b, bad, gen(1))


def test_wrong_shape_or_dtype_fails() -> None:
    a, b = operands(None, 8, 16, 6, torch.float32, 1.0, 1)
    c = honest(a, b)
    assert not freivalds_ok(a, b, c[:-1], new_generator())
    assert not freivalds_ok(a, b, c[:, :-1], new_generator())
    assert not freivalds_ok(a, b, c.reshape(6, 8), new_generator())
    assert not freivalds_ok(a, b, c.unsqueeze(0), new_generator())
    assert not freivalds_ok(a, b, c.reshape(-1), new_generator())
    assert not freivalds_ok(a, b, c.double(), new_generator())
    assert not freivalds_ok(a, b, c.to(torch.bfloat16), new_generator())
    assert not freivalds_ok(a, b, c.to(torch.int32), new_generator())
    ab, bb = operands(3, 8, 16, 6, torch.float32, 1.0, 2)
    cb = honest(ab, bb)
    assert freivalds_ok(ab, bb, cb, new_generator())
    assert not freivalds_ok(ab, bb, cb[:2], new_generator())
    assert not freivalds_ok(ab, bb, cb[0], new_generator())
    assert not freivalds_ok(ab, bb, cb.half(), new_generator())


# ---- known bugs -------------------------------------------------------------------------


def test_half_precision_garbage_fails() -> None:
    accepted = []
    cases = [
        (torch.bfloat16, (None, 64, 64, 64)),
        (torch.bfloat16, (3, 32, 256, 32)),
        (torch.bfloat16, (None, 128, 4096, 64)),
        (torch.float16, (None, 128, 4096, 64)),
        (torch.float16, (None, 17, 8192, 9)),
    ]
    for i, (dtype, (batch, m, k, n)) in enumerate(cases):
        a, b = operands(batch, m, k, n, dtype, 1.0, 40 + i)
        c = honest(a, b)
        wrong = {"zeros": torch.zeros_like(c)}
        if m == n:
            wrong["transposed"] = c.transpose(-1, -2).contiguous()
        for what, bad in wrong.items():
            if freivalds_ok(a, b, bad, gen(i)):
                accepted.append((dtype, (batch, m, k, n), what))
    assert not accepted, accepted


def test_honest_fp16_products_in_the_subnormal_range_pass() -> None:
    rejected = []
    for seed in range(20):
        g = gen(seed)
        a = (torch.randn(8, 1, generator=g) * 0.003).half()
        b = (torch.randn(1, 8, generator=g) * 0.003).half()
        if not freivalds_ok(a, b, honest(a, b), gen(seed)):
            rejected.append(seed)
    assert not rejected, rejected


def test_check_leaves_the_global_rng_alone() -> None:
    a, b = operands(None, 16, 32, 8, torch.float32, 1.0, 0)
    c = honest(a, b)
    state = torch.random.get_rng_state()
    assert freivalds_ok(a, b, c, new_generator())
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_single_wrong_entry_is_caught_on_every_check() -> None:
    """The check vector has no near-zero weights, so one entry off by a few percent of the
    tile's scale is caught every time, not just usually (what a subtle cheat would try)."""
    g = torch.Generator().manual_seed(7)
    checks = new_generator()
    missed = 0
    for trial in range(200):
        m, k, n = (int(x) for x in torch.randint(8, 257, (3,), generator=g))
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        c = a @ b
        assert freivalds_ok(a, b, c, checks)
        i, j = trial % m, (7 * trial) % n
        wrong = c.clone()
        wrong[i, j] += 0.05 * float(c.abs().max()) * (1 if trial % 2 else -1)
        missed += freivalds_ok(a, b, wrong, checks)
    assert missed == 0


# ---- how the check cuts a tile, and what it keeps ---------------------------------------


@pytest.mark.parametrize(
    ("shape", "plan"),
    [
        # (batch, m, k, n) -> rows, chunks, width, vectors, K blocks
        ((1, 1, 16, 1), CheckPlan(1, 1, 1, 1, 1)),
        ((1, 16, 16, 16), CheckPlan(16, 1, 16, 4, 1)),
        ((1, 1, 4096, 256), CheckPlan(1, 1, 256, 8, 16)),  # one row: eight vectors
        ((1, 256, 256, 256), CheckPlan(256, 1, 256, 4, 1)),
        ((16, 256, 64, 256), CheckPlan(4096, 1, 256, 4, 1)),
        # K x N above 2^18: the reference is summed in blocks of K, and rows are cut
        # into chunks as far as one reference column per 128 columns allows.
        ((1, 256, 16384, 256), CheckPlan(256, 1, 256, 4, 64)),
        ((1, 1024, 1024, 1024), CheckPlan(1024, 2, 512, 4, 4)),
        ((1, 2048, 2048, 2048), CheckPlan(2048, 4, 512, 4, 8)),
        ((1, 4096, 16384, 4096), CheckPlan(4096, 8, 512, 4, 64)),
        ((1, 256, 1031, 2048), CheckPlan(256, 4, 512, 4, 1)),  # prime K: one chain
    ],
)
def test_check_plan_table(shape: tuple[int, int, int, int], plan: CheckPlan) -> None:
    assert CheckPlan.for_shape(*shape) == plan


def test_threshold_grows_with_the_statistics_and_covers_an_exponential_tail() -> None:
    values = [threshold(n) for n in (1, 64, 4096, 1 << 17)]
    assert values == sorted(values)
    # One statistic at 1e-9: the Gaussian quantile is 6.1; the exponential tail of a
    # statistic one chain dominates needs more.
    assert 8.5 < threshold(1) < 9.0
    assert 13.5 < threshold(1 << 17) < 14.5


def grid_tiles(gm: int, gn: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    a, b = operands(None, 64 * gm, 512, 64 * gn, torch.float32, 1.0, seed)
    return list(a.split(64)), list(b.split(64, dim=1))


def test_a_cache_shares_operand_summaries_and_gives_the_same_verdicts() -> None:
    rows, cols = grid_tiles(3, 2, 21)
    cache = CheckCache()
    for i, a in enumerate(rows):
        for j, b in enumerate(cols):
            c = honest(a, b)
            bad = c.clone()
            bad[5, 7] += 1e-3 * float(c.abs().max())
            for result, expected in ((c, True), (bad, False)):
                cached = check_product(a, b, result, gen(i), cache=cache, blocks=(f"a{i}", f"b{j}"))
                assert cached.ok is expected
                assert check_product(a, b, result, gen(i)).ok is expected
    assert len(cache) == 3 + 2  # one summary per row block and per column block


def test_a_cache_keeps_only_its_budget_of_bytes() -> None:
    rows, cols = grid_tiles(4, 1, 22)
    # A row block's summary is 64 float64 row norms (512 bytes); the column block's is
    # b ρ, the four vectors and its largest row norm: room for it and two row blocks.
    right = 512 * 4 * 4 + 64 * 4 * 4 + 8
    cache = CheckCache(budget_bytes=right + 2 * 512)
    for i, a in enumerate(rows):
        assert check_product(a, cols[0], honest(a, cols[0]), gen(i), cache=cache, blocks=(i, 0)).ok
    assert len(cache) == 3  # the column block and the last two row blocks


def test_magnitudes_beyond_fp32_norms_are_checked_in_float64() -> None:
    # Row norms of these overflow fp32 (|c| ~ 1e21): the check is redone in float64.
    a, b = operands(None, 16, 64, 8, torch.float32, 1e10, 23)
    c = honest(a, b)
    assert freivalds_ok(a, b, c, gen(1))
    wrong = c.clone()
    wrong[3, 4] *= 1.001
    assert not freivalds_ok(a, b, wrong, gen(1))
    # A cheat cannot inflate the tolerance by sending huge values.
    assert not freivalds_ok(a, b, torch.full_like(c, 3e38), gen(1))
    assert not freivalds_ok(a, b, c * 1e17, gen(1))


# (a row scale, b's scale) that takes the first rows of a product past its dtype's
# range, as a model blowing up does, while the other rows stay small.
OVERFLOWING = {
    torch.float16: (250.0, 25.0),
    torch.bfloat16: (1e19, 3e18),
    torch.float32: (1e19, 3e18),
}


@pytest.mark.parametrize("dtype", list(OVERFLOWING))
def test_an_honest_product_past_its_dtypes_range_passes_and_cheats_in_it_fail(
    dtype: torch.dtype,
) -> None:
    """An honest kernel rounds a sum past the largest finite value to inf: a job whose
    activations outgrow fp16 must not get its volunteers banned. Each infinity must be
    one an honest sum can round to, and the finite rest is checked as ever."""
    row_scale, b_scale = OVERFLOWING[dtype]
    for batch, m, k, n in ((None, 24, 128, 20), (2, 12, 64, 10)):
        a, b = operands(batch, m, k, n, dtype, 1.0, 5)
        a[..., :4, :] *= row_scale
        b *= b_scale
        c = honest(a, b)
        past = ~torch.isfinite(c)
        assert past.any() and past[..., 4:, :].sum() == 0 and torch.isfinite(a).all()
        assert freivalds_ok(a, b, c, gen(1)), (dtype, batch)
        off = c.clone()
        off[..., 4:, :] = with_one_element_changed(a[..., 4:, :], b, c[..., 4:, :], 0.01, 3)
        cheats = {"one small entry off by 1% of its row": off}
        cheats["inf where the sum is small"] = c.clone()
        cheats["inf where the sum is small"][(0,) * (c.dim() - 2) + (5, 2)] = math.inf
        cheats["infinities everywhere"] = torch.full_like(c, math.inf)
        if dtype == torch.float16:  # the accumulation cannot overflow: sign and NaN tell
            cheats["an overflow's sign flipped"] = torch.where(past, -c, c)
            cheats["NaN for an overflow"] = torch.where(past, math.nan, c)
        for what, bad in cheats.items():
            assert not freivalds_ok(a, b, bad, gen(1)), (dtype, batch, what)
        verdicts = check_products([(a, b, c), (a, b, cheats["inf where the sum is small"])], gen(2))
        assert [v.ok for v in verdicts] == [True, False]


# Powers of two, so that scaling an honest product scales its rounding exactly: the
# squares of entries below about 1e-19 are subnormal in fp32, below 3e-23 zero. Not
# bf16 at 2**-120: its kernels may flush subnormals, and a result's allowance for that
# (about fp32's smallest normal, per operation) is as large as a 1% error there.
TINY_SCALES = [
    *(
        (dtype, scale)
        for dtype in (torch.float32, torch.bfloat16)
        for scale in (2.0**-40, 2.0**-66, 2.0**-80, 2.0**-100)
    ),
    (torch.float32, 2.0**-120),
]


@pytest.mark.parametrize("dtype, scale", TINY_SCALES)
def test_tiny_magnitudes_get_the_verdicts_of_the_same_tile_at_unit_scale(
    dtype: torch.dtype, scale: float
) -> None:
    """The gradients of a well-fitted model (a language model whose tied embedding makes
    its targets easy, late in training) are many orders of magnitude below 1: fp32 norms
    of such rows underflowed to zero, the honest rounding bound with them, and honest
    workers were banned. Scaled by a power of two, a tile must get the verdict it gets
    unscaled, alone, in a stack and laid out transposed; the tiny operand is ``a``, as a
    gradient is, or both, and some of its rows are zero (padding)."""
    for i, (batch, m, k, n) in enumerate(TAMPER_SHAPES):
        a, b = operands(batch, m, k, n, torch.float32, 1.0, 1200 + i)
        a[..., ::5, :] = 0.0
        for a_scale, b_scale in ((scale, 1.0), (2.0**-20, scale * 2.0**20)):
            at, bt = (a * a_scale).to(dtype), (b * b_scale).to(dtype)
            c = honest(at, bt)
            bad = with_one_element_changed(at, bt, c, 0.01, i)
            case = (batch, m, k, n, a_scale, b_scale)
            assert check_product(at, bt, c, gen(i)).ok, case
            assert not check_product(at, bt, bad, gen(i)).ok, case
            assert check_product(transposed_layout(at), bt, c, gen(i)).ok, case
            assert check_product(at, transposed_layout(bt), c, gen(i)).ok, case
            verdicts = check_products([(at, bt, c), (at, bt, bad), (at, bt, c)], gen(i))
            assert [v.ok for v in verdicts] == [True, False, True], case


def test_the_margin_reports_how_close_a_result_came() -> None:
    a, b = operands(None, 64, 256, 64, torch.float32, 1.0, 24)
    c = honest(a, b)
    honest_result = check_product(a, b, c, gen(1))
    assert honest_result.ok and 0 < honest_result.margin < 0.5
    assert honest_result.statistics == 64 * 4  # a statistic per row and vector
    wrong = check_product(a, b, c * (1 + 1e-4), gen(1))
    assert not wrong.ok and wrong.margin > 1 and wrong.reason is CheckReason.MISMATCH
    assert check_product(a, b, c.double(), gen(1)).reason is CheckReason.DTYPE
    assert check_product(a, b, c[:-1], gen(1)).reason is CheckReason.SHAPE
    poisoned = c.clone()
    poisoned[0, 0] = math.nan
    assert check_product(a, b, poisoned, gen(1)).reason is CheckReason.NON_FINITE


@pytest.mark.parametrize(
    "batch, m, k, n",
    # The last: stacked still (STACK_MAX_MACS), with the reference summed in K blocks.
    [(None, 64, 64, 64), (None, 2, 1024, 1024), (3, 16, 40, 8), (None, 128, 1024, 512)],
)
def test_a_batch_of_tiles_sharing_operand_blocks_gets_each_tile_its_own_verdict(
    batch: int | None, m: int, k: int, n: int
) -> None:
    # The tiles of a grid share their row and column blocks (the same tensors, or the
    # same content ids): each block is summarised once and each a read once for all
    # its tiles, and every tile must still be paired with its own blocks.
    rows = [operands(batch, m, k, n, torch.float32, 1.0, seed)[0] for seed in range(3)]
    cols = [operands(batch, m, k, n, torch.float32, 1.0, 10 + seed)[1] for seed in range(3)]
    tiles = [(rows[i], cols[j], honest(rows[i], cols[j])) for i in range(3) for j in range(3)]
    wrong = tiles[5][2].clone()
    wrong.view(-1)[7] += 1e-3 * float(wrong.abs().max())
    tiles[5] = (tiles[5][0], tiles[5][1], wrong)
    blocks = [(i, j) for i in range(3) for j in range(3)]
    for keys in (None, blocks):
        verdicts = check_products(tiles, gen(1), blocks=keys)
        assert [v.ok for v in verdicts] == [i != 5 for i in range(9)]
        assert all(
            v.statistics == CheckPlan.for_shape(batch or 1, m, k, n).statistics for v in verdicts
        )


def transposed_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last two dims swapped in memory, as a transposed block arrives."""
    return t.mT.contiguous().mT


@pytest.mark.parametrize(
    "batch, m, k, n",
    # The last two: rows cut into column chunks, the reference summed in K blocks.
    [(None, 33, 65, 17), (4, 16, 64, 32), (None, 256, 1024, 1024), (2, 64, 2048, 512)],
)
@pytest.mark.parametrize("which", ["a", "b", "ab"])
def test_operands_laid_out_transposed_get_the_same_verdicts(
    batch: int | None, m: int, k: int, n: int, which: str
) -> None:
    """A weight block is sent as its transpose and checked as the view the worker
    multiplies: the check must read it in place, and judge as it would a copy."""
    a, b = operands(batch, m, k, n, torch.float32, 1.0, 3)
    c = honest(a, b)
    wrong = c.clone()
    wrong.view(-1)[c.numel() // 2] += 1e-3 * float(c.abs().max())
    at = transposed_layout(a) if "a" in which else a
    bt = transposed_layout(b) if "b" in which else b
    assert not (at.is_contiguous() and bt.is_contiguous())
    assert check_product(at, bt, c, gen(9)).ok
    assert not check_product(at, bt, wrong, gen(9)).ok
    tiles = [(at, bt, c), (at, bt, wrong), (a, b, c)]
    assert [v.ok for v in check_products(tiles, gen(9))] == [True, False, True]


@pytest.mark.parametrize("which", ["a", "b"])
def test_a_worker_that_ignores_the_transposed_mark_is_caught(which: str) -> None:
    """A square block sent transposed can be multiplied as its bytes lie, untransposed,
    without any shape error: an old or lazy worker's product that must fail."""
    a, b = operands(None, 64, 64, 64, torch.float32, 1.0, 11)
    at, bt = transposed_layout(a), transposed_layout(b)
    sent = (at, b) if which == "a" else (a, bt)
    as_bytes_lie = at.mT @ b if which == "a" else a @ bt.mT
    assert check_product(*sent, honest(*sent), gen(3)).ok
    assert not check_product(*sent, as_bytes_lie, gen(3)).ok
    verdicts = check_products([(*sent, as_bytes_lie), (*sent, honest(*sent))], gen(3))
    assert [v.ok for v in verdicts] == [False, True]


ROW_SHAPES = (  # (batch or None, m, k, n) of each of a row's four tiles
    (None, 48, 512, 64),  # one chain per statistic
    (None, 32, 1024, 512),  # rows cut into chunks, the reference summed in K blocks
    (3, 16, 256, 32),  # bmm
)


def count_references(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the check reads an ``a`` for references ``a (b ρ)``."""
    import coordinator.tiles.verify as verify

    calls = [0]
    real = verify._reference

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(verify, "_reference", counted)
    return calls


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("layout", ["rows", "bT"])
@pytest.mark.parametrize("cheat_at", [0, 2])
@pytest.mark.parametrize("cheat", ["one entry", "a row neighbour's result"])
def test_a_row_of_tiles_takes_its_references_from_one_read_of_a(
    shape: tuple[int | None, int, int, int],
    layout: str,
    cheat_at: int,
    cheat: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch, m, k, n = shape
    a, b = operands(batch, m, k, 4 * n, torch.float32, 1.0, 31)
    cols = list(b.split(n, dim=-1))
    if layout == "bT":  # a weight as the forward sends it: lying transposed
        cols = [col.mT.contiguous().mT for col in cols]
    reads = count_references(monkeypatch)
    cache = CheckCache()
    for j, col in enumerate(cols):
        c = honest(a, col)
        if j == cheat_at and cheat == "one entry":
            c = c.clone()
            c[..., 1, 3] += 1e-2 * float(c.abs().max())
        elif j == cheat_at:  # honest work, for the tile whose reference sits beside it
            c = honest(a, cols[j + 1])
        verdict = check_product(
            a,
            col,
            c,
            gen(j),
            cache=cache,
            blocks=("a", j),
            partners=lambda j=j: [(later, cols[later]) for later in range(j + 1, len(cols))],
        )
        assert verdict.ok is (j != cheat_at), (j, verdict)
        if j == cheat_at:
            assert verdict.reason is CheckReason.MISMATCH
    assert reads[0] == 1  # the first tile's read made all four


def test_a_kept_reference_serves_only_the_summary_of_b_it_was_made_with() -> None:
    rows, cols = grid_tiles(1, 4, 32)
    a = rows[0]

    class Forgetful(CheckCache):
        """Hands out a new summary of b, with a new ρ, each time: as after the cache let
        go of one, or another checker put its own first."""

        def right(
            self, key: Hashable, b3: torch.Tensor, plan: CheckPlan, generator: torch.Generator
        ) -> RightSummary:
            return summarize_right(b3, plan, generator)

    cache = Forgetful()
    for j, col in enumerate(cols):
        later = [(i, cols[i]) for i in range(j + 1, 4)]
        c = honest(a, col)
        verdict = check_product(
            a, col, c, gen(j), cache=cache, blocks=("a", j), partners=lambda later=later: later
        )
        assert verdict.ok, (j, verdict)
    assert len(cache) == 1 + 3  # a's summary, and the references nobody could use

    plan = CheckPlan.for_shape(1, 64, 512, 64)
    b3 = cols[0].unsqueeze(0)
    made_with, other = (summarize_right(b3, plan, gen(seed)) for seed in (1, 2))
    values = torch.zeros(1, 64, 4, dtype=torch.float64)
    cache.keep_reference("a", 0, made_with, values)
    assert cache.reference("a", 0, made_with) is values
    assert cache.reference("a", 0, other) is None
    cache.keep_reference("a", 0, other, values + 1)  # a new one replaces it
    assert cache.reference("a", 0, made_with) is None
    assert cache.reference("a", 0, other) is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_check_leaves_its_operands_and_result_as_they_were(dtype: torch.dtype) -> None:
    # b's rows far apart in size: the check sums the squared terms exactly, from a
    # squared copy of a (in float64, the dtype a float64 tile already has).
    a, b = operands(None, 40, 256, 48, torch.float32, 1.0, 33)
    b = (b * torch.logspace(-3, 3, 256).unsqueeze(1)).to(dtype)
    a = a.to(dtype)
    c = honest(a, b)
    kept = [t.clone() for t in (a, b, c)]
    assert check_product(a, b, c, gen(1)).ok
    assert check_product(a, b, c, gen(2), cache=CheckCache(), blocks=("a", "b")).ok
    for now, before in zip((a, b, c), kept, strict=True):
        assert torch.equal(now, before)
