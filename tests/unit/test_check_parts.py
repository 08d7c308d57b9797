"""The result check's building blocks against plain torch (coordinator.tiles.check_parts):
row-chunk norms and products by the check vectors, for blocks in row order and blocks
that lie transposed (as weight blocks are sent), several blocks into one answer with
their row norms taken on the way, and the references ``a (b ρ)``; the products both as
torch makes them and as numba's compiled loops do (coordinator.tiles.row_products)."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.tiles import check_parts, row_products
from coordinator.tiles.check_parts import chunk_norms, rows_times_each
from coordinator.tiles.verify import _reference

SHAPES = ((1, 64, 64, 1), (1, 300, 96, 3), (2, 128, 512, 4), (1, 1024, 768, 2), (3, 17, 40, 5))


def _block(batch: int, rows: int, cols: int, transposed: bool, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * cols + batch)
    if transposed:
        return torch.randn(batch, cols, rows, generator=gen, dtype=dtype).mT
    return torch.randn(batch, rows, cols, generator=gen, dtype=dtype)


@pytest.fixture(params=["torch", "compiled"])
def products(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which products ``rows_times_each`` takes, for every size: torch's, or the loops
    numba compiles (skipped where numba is missing)."""
    if request.param == "torch":
        monkeypatch.setattr(row_products, "kernels", lambda: None)
    else:
        if row_products.kernels() is None:
            pytest.skip("numba is not installed")
    return str(request.param)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunk_norms_and_rows_times_match_torch(
    transposed: bool, dtype: torch.dtype, products: str
) -> None:
    for batch, rows, cols, chunks in SHAPES:
        x = _block(batch, rows, cols, transposed, dtype)
        width = cols // chunks
        expected = torch.linalg.vector_norm(x.reshape(batch, rows, chunks, width), dim=-1)
        torch.testing.assert_close(chunk_norms(x, chunks, width), expected)
        v = torch.randn(width, 4, dtype=dtype, generator=torch.Generator().manual_seed(cols))
        # Blocks of one shape in one call, each into its own part of the answer; the
        # largest shapes are multiplied in several row slices.
        norms = torch.full((2, batch * rows * chunks), math.nan, dtype=dtype)
        blocks = [x, x.flip(-2)]
        projected = rows_times_each(blocks, width, v, norms).view(2, batch, rows, chunks, 4)
        for block, each, each_norms in zip(blocks, projected, norms, strict=True):
            chunked = block.reshape(batch, rows, chunks, width).double()
            expected = torch.einsum("brcw,wv->brcv", chunked, v.double()).to(dtype)
            # Sums of up to 512 terms of about 1 in another order: fp32 rounding apart.
            tolerance = 1e-4 if dtype == torch.float32 else 1e-10
            torch.testing.assert_close(each, expected, rtol=tolerance, atol=tolerance)
            norms_expected = torch.linalg.vector_norm(chunked, dim=-1).to(dtype)
            torch.testing.assert_close(each_norms.view(batch, rows, chunks), norms_expected)


@pytest.mark.parametrize("vectors", [4, 8])
def test_the_compiled_loops_sum_what_torch_sums_or_leave_the_block_to_it(vectors: int) -> None:
    """Every row of every chunk, in order and transposed, batched, with any number of
    vectors; infinities and NaNs come through; a block laid out otherwise (a strided
    view) is left to torch, untouched."""
    compiled = row_products.kernels()
    if compiled is None:
        pytest.skip("numba is not installed")
    gen = torch.Generator().manual_seed(vectors)
    v_t = torch.randn(vectors, 64, generator=gen)
    for transposed in (False, True):
        x = _block(3, 40, 128, transposed, torch.float32)
        x[1, 7, 5] = math.inf
        x[2, 3, 70] = math.nan
        out = torch.full((vectors, 3 * 40 * 2), math.nan)
        norms = torch.full((3 * 40 * 2,), math.nan)
        assert compiled.row_products(x, 64, v_t, out, norms, transposed)
        chunked = x.reshape(3, 40, 2, 64).double()
        expected = torch.einsum("brcw,vw->vbrc", chunked, v_t.double()).reshape(vectors, -1)
        torch.testing.assert_close(out, expected.float(), rtol=1e-4, atol=1e-4, equal_nan=True)
        expected_norms = torch.linalg.vector_norm(chunked, dim=-1).reshape(-1).float()
        torch.testing.assert_close(norms, expected_norms, equal_nan=True)
        assert out[:, (1 * 40 + 7) * 2].isinf().all() and out[:, (2 * 40 + 3) * 2 + 1].isnan().all()
    strided = torch.randn(40, 256)[:, :128]
    untouched = torch.full((vectors, 80), 7.0)
    assert not compiled.row_products(strided, 64, v_t, untouched, None, False)
    assert bool((untouched == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_references_match_float64_sums_of_each_k_block(dtype: torch.dtype, products: str) -> None:
    """``a (b ρ)`` as the check makes it (``verify._reference``), both ways: each block
    of K summed in the operands' dtype, the blocks added in float64; odd row counts,
    column counts that are not a multiple of four, batches and a leading dim."""
    gen = torch.Generator().manual_seed(3)
    for lead, batch, m, k, cols, k_blocks in (
        ((), 1, 512, 768, 4, 3),
        ((), 1, 7, 64, 5, 1),
        ((3,), 2, 33, 96, 12, 2),
        ((), 4, 1, 40, 8, 4),
    ):
        a = torch.randn(*lead, batch, m, k, generator=gen, dtype=dtype)
        projected = torch.randn(batch, k, cols, generator=gen, dtype=dtype)
        plan = check_parts.CheckPlan(batch * m, 1, cols, cols, k_blocks)
        got = _reference(a, projected, plan)
        expected = torch.einsum("...bmk,bkc->...bmc", a.double(), projected.double())
        assert got.dtype == torch.float64 and got.shape == expected.shape
        # Blocks of up to 768 terms of about 1: the operands' rounding apart.
        tolerance = 1e-4 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    if dtype == torch.float32:
        # Each block of K is a sum of its own, the blocks added in float64: two terms
        # near the largest fp32 on either side of a block's end overflow only together.
        a = torch.ones(1, 2, 300)
        projected = torch.zeros(1, 300, 4)
        projected[0, 99:101] = 2e38
        total = 2 * float(projected[0, 99, 0])
        plan = check_parts.CheckPlan(2, 1, 4, 4, 3)
        assert bool((_reference(a, projected, plan) == total).all())


def test_the_compiled_reference_of_a_tile_is_the_same_alone_and_with_others() -> None:
    """A tile's reference made with its row's (more columns) or in a stack (more
    blocks of a) is bit for bit the one it gets alone, as a stack's verdicts must be
    those of its tiles alone; infinities and NaNs come through; an ``a`` that does not
    lie in order is left to torch."""
    compiled = row_products.kernels()
    if compiled is None:
        pytest.skip("numba is not installed")
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(2, 9, 300, generator=gen)  # odd rows: the last is paired with itself
    mine = torch.randn(2, 300, 4, generator=gen)
    others = torch.randn(2, 300, 7, generator=gen)
    alone = compiled.reference(a, mine, 3)
    assert alone is not None
    joined = compiled.reference(a, torch.cat([others, mine, others], dim=-1), 3)
    assert joined is not None
    assert torch.equal(joined[..., 7:11], alone)
    stack = torch.stack([torch.randn(2, 9, 300, generator=gen), a, a.flip(-2)])
    stacked = compiled.reference(stack, mine, 3)
    assert stacked is not None
    assert torch.equal(stacked[1], alone)
    assert torch.equal(stacked[2], alone.flip(-2))
    a[1, 4, 17] = math.inf
    a[0, 8, 2] = math.nan
    broken = compiled.reference(a, mine, 3)
    assert broken is not None
    assert broken[1, 4].isinf().all() and broken[0, 8].isnan().all()
    assert torch.equal(broken[0, :8], alone[0, :8])
    assert compiled.reference(a.mT.contiguous().mT, mine, 3) is None
    assert compiled.reference(a.double(), mine, 3) is None
