"""Free heap memory goes back to the system between training steps, once it is large."""

from __future__ import annotations

import sys

import psutil
import pytest

from coordinator.step.heap import free_heap_bytes, release_free_memory

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
    assert release_free_memory(above_bytes=0)
    released = before - process.memory_info().rss
    assert released > 128 << 20, f"only {released >> 20} MiB went back"
    assert len(kept) == 256


def test_the_heap_is_left_alone_while_its_free_memory_is_under_the_bound() -> None:
    kept = _fragmented()
    free = free_heap_bytes()
    assert free is not None and free > 128 << 20
    process = psutil.Process()
    before = process.memory_info().rss
    assert not release_free_memory(above_bytes=free + (64 << 20))
    assert process.memory_info().rss > before - (32 << 20)  # nothing handed back
    assert release_free_memory(above_bytes=free // 2)
    assert len(kept) == 256
