"""Free heap memory goes back to the system between training steps, once it is large:
larger than a bound and than the memory the heap has in use."""

from __future__ import annotations

import sys

import psutil
import pytest

from coordinator.step.heap import heap_bytes, release_free_memory, trim_due

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")


def _fragmented() -> list[bytearray]:
    """256 MiB of small blocks (from the heap, not mmap), all but every 16th freed: the
    free ones are pinned below blocks in use, where the heap cannot shrink by itself."""
    blocks = [bytearray(64 << 10) for _ in range(4096)]  # every page touched
    return blocks[::16]


def test_free_memory_between_blocks_still_in_use_goes_back_to_the_system() -> None:
    kept = _fragmented()
    process = psutil.Process()
    before = process.memory_info().rss
    assert release_free_memory(above_bytes=0, up_to_in_use=False)
    released = before - process.memory_info().rss
    assert released > 128 << 20, f"only {released >> 20} MiB went back"
    assert len(kept) == 256


def test_the_heap_is_left_alone_while_its_free_memory_is_under_the_bound() -> None:
    kept = _fragmented()
    heap = heap_bytes()
    assert heap is not None
    free = heap[0]
    assert free > 128 << 20
    process = psutil.Process()
    before = process.memory_info().rss
    assert not release_free_memory(above_bytes=free + (64 << 20), up_to_in_use=False)
    assert process.memory_info().rss > before - (32 << 20)  # nothing handed back
    assert release_free_memory(above_bytes=free // 2, up_to_in_use=False)
    assert len(kept) == 256


@pytest.mark.parametrize(
    ("free", "in_use", "up_to_in_use", "due"),
    [
        (100, 1000, True, False),  # under the bound
        (300, 1000, True, False),  # over the bound, but a step's worth beside what is in use
        (1000, 1000, True, False),
        (1001, 1000, True, True),  # more free than in use: trimmed
        (300, 1000, False, True),  # the bound alone
        (200, 100, False, False),
    ],
)
def test_a_heap_is_trimmed_once_more_is_free_than_the_bound_and_than_is_in_use(
    free: int, in_use: int, up_to_in_use: bool, due: bool
) -> None:
    assert trim_due(free, in_use, above_bytes=256, up_to_in_use=up_to_in_use) is due
