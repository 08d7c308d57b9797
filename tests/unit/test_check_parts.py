"""The result check's building blocks against plain torch (coordinator.tiles.check_parts):
row-chunk norms and products by the check vectors, for blocks in row order and blocks
that lie transposed (as weight blocks are sent), several blocks into one answer with
their row norms taken on the way."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.tiles.check_parts import chunk_norms, rows_times_each

SHAPES = ((1, 64, 64, 1), (1, 300, 96, 3), (2, 128, 512, 4), (1, 1024, 768, 2), (3, 17, 40, 5))


def _block(batch: int, rows: int, cols: int, transposed: bool, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * cols + batch)
    if transposed:
        return torch.randn(batch, cols, rows, generator=gen, dtype=dtype).mT
    return torch.randn(batch, rows, cols, generator=gen, dtype=dtype)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunk_norms_and_rows_times_match_torch(transposed: bool, dtype: torch.dtype) -> None:
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
