"""StepBlocks: a block cut again from unchanged memory takes the earlier cut's id (and
bytes) without hashing; anything else is cut and hashed afresh, and every id is its
bytes' content id."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

import common.tensors
from common.tensors import content_id
from coordinator.tiles.step_blocks import StepBlocks


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The bytes hashed while a test runs (by ``encode_block``)."""
    counted: list[int] = []

    def counting(t: torch.Tensor) -> str:
        counted.append(t.numel() * t.element_size())
        return content_id(t)

    monkeypatch.setattr(common.tensors, "content_id", counting)
    yield counted


def _is_its_content(block: common.tensors.Block, view: torch.Tensor) -> None:
    assert torch.equal(block.tensor, view)
    stored = block.tensor.mT if block.transposed else block.tensor
    assert block.id == content_id(stored.contiguous())


def test_a_block_cut_again_from_unchanged_memory_is_not_hashed_again(hashed: list[int]) -> None:
    blocks = StepBlocks()
    x = torch.randn(64, 48)
    first, fresh = blocks.encode(x[:, 16:32])  # a column block: copied out
    assert fresh and hashed == [64 * 16 * 4]
    again, fresh = blocks.encode(x[:, 16:32])  # another view of the same bytes
    assert again is first and not fresh and len(hashed) == 1
    # Read the other way round (a weight in its forward, then in its input gradient):
    # the same bytes, the same id, no copy.
    turned, fresh = blocks.encode(x.t()[16:32, :])
    assert not fresh and len(hashed) == 1
    assert turned.id == first.id and turned.transposed and turned.data is first.data
    _is_its_content(turned, x.t()[16:32, :])
    # Another block of the same matrix is other bytes.
    other, fresh = blocks.encode(x[:, 32:48])
    assert fresh and other.id != first.id and len(hashed) == 2


def test_once_the_first_block_is_let_go_its_id_still_serves(hashed: list[int]) -> None:
    blocks = StepBlocks()
    x = torch.randn(32, 32)
    block_id = blocks.encode(x[:, :8])[0].id
    gc.collect()  # no tile holds the block any more
    again, fresh = blocks.encode(x[:, :8])
    assert not fresh and again.id == block_id and len(hashed) == 1
    _is_its_content(again, x[:, :8])


def test_a_block_changed_in_place_is_hashed_afresh(hashed: list[int]) -> None:
    blocks = StepBlocks()
    w = torch.randn(16, 16)
    before = blocks.encode(w[:8])[0]
    w.add_(1.0)  # the optimizer's step, or any in-place op of the graph
    after, fresh = blocks.encode(w[:8])
    assert fresh and after.id != before.id
    _is_its_content(after, w[:8])


def test_memory_freed_and_given_to_another_matrix_is_not_taken_for_the_first() -> None:
    # Matrices of one shape made and dropped in turn: the allocator hands the same
    # memory out again, with the same strides and version, and only the dead owner
    # tells the old matrix from the new one.
    blocks = StepBlocks()
    addresses = set()
    for i in range(24):
        m = torch.full((256, 256), float(i))
        addresses.add(m.data_ptr())
        block, _ = blocks.encode(m[:, :128])
        _is_its_content(block, m[:, :128])
        del m, block
        gc.collect()
    assert len(addresses) < 24  # the case under test did happen


def test_tensors_without_a_version_are_always_hashed(hashed: list[int]) -> None:
    blocks = StepBlocks()
    with torch.inference_mode():
        x = torch.randn(8, 8)
    for _ in range(2):
        assert blocks.encode(x[:4])[1]
    assert len(hashed) == 2


def test_past_its_limit_the_oldest_names_are_let_go(hashed: list[int]) -> None:
    blocks = StepBlocks(limit=2)
    x = torch.randn(6, 4)
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        blocks.encode(x[rows])
    assert len(blocks) == 2
    assert blocks.encode(x[0:2])[1]  # forgotten: cut again
    assert not blocks.encode(x[4:6])[1]
