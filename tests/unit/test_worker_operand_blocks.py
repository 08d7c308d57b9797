"""The worker's operand cache (client_app.operands.OperandBlocks): blocks kept as views of
the message they came in, copied when that message would otherwise stay alive for bytes
the cache does not count, in the order and sizes of the coordinator's mirror."""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch

from client_app.operands import EXTRA_KEPT_ALIVE, OperandBlocks
from common.block_cache import BlockCache
from common.frames import decode_frame, encode_frame
from common.messages import BLOCK_FIELD, Received
from common.tensors import decode_tensors, encode_tensors

BLOCK_BYTES = 4096


def _block(seed: int, rows: int = 32) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, 32), np.float32))


def _message(
    blocks: list[tuple[str, torch.Tensor | None]], extra: torch.Tensor | None = None
) -> tuple[Received, dict[str, torch.Tensor], bytes]:
    """A task's frame carrying the blocks given a tensor (None: referred to, not sent),
    and ``extra`` inline bytes no block id names; the blocks that arrived, as decoded."""
    inline = [(block, t) for block, t in blocks if t is not None]
    if extra is not None:
        inline.append(("extra", extra))
    descriptors, parts = encode_tensors(inline)
    for desc, (block, _) in zip(descriptors, inline, strict=True):
        if block != "extra":
            desc[BLOCK_FIELD] = block
    refs = [{"name": block, BLOCK_FIELD: block, "ref": True} for block, t in blocks if t is None]
    data = encode_frame({"v": 1, "type": "task", "tensors": descriptors + refs}, parts)
    frame = decode_frame(data)
    decoded = decode_tensors(descriptors, frame.payload)
    arrived = {block: decoded[block] for block, _ in inline if block != "extra"}
    return Received(message=cast(Any, None), frame=frame), arrived, data


def _inside(t: torch.Tensor, data: bytes) -> bool:
    start = np.frombuffer(data, np.uint8).ctypes.data
    return start <= t.data_ptr() < start + len(data)


def test_blocks_that_are_their_message_are_kept_as_views() -> None:
    cache = OperandBlocks(10 * BLOCK_BYTES)
    received, arrived, data = _message([("a", _block(1)), ("b", _block(2))])
    cache.keep(received, arrived)
    assert list(cache) == ["a", "b"]
    assert all(cache[k].data_ptr() == arrived[k].data_ptr() for k in "ab")


def test_a_block_let_go_frees_its_message_by_copying_the_ones_that_stay() -> None:
    cache = OperandBlocks(2 * BLOCK_BYTES)
    first, arrived, data = _message([("a", _block(1)), ("b", _block(2))])
    cache.keep(first, arrived)
    b = cache["b"].clone()
    # c arrives and b is referred to: a, the least recently used, goes.
    second, arrived2, _ = _message([("b", None), ("c", _block(3))])
    cache.keep(second, arrived2)
    assert list(cache) == ["c", "b"]
    assert not _inside(cache["b"], data) and torch.equal(cache["b"], b)
    assert _inside(cache["c"], second.frame.payload.obj)  # type: ignore[arg-type]


def test_blocks_from_a_message_with_other_bytes_are_copied() -> None:
    cache = OperandBlocks(10 * BLOCK_BYTES)
    # An inline operand with no block id (or a batch's other tasks): more than the
    # allowance of bytes the cache would keep alive without counting them.
    received, arrived, data = _message([("a", _block(1))], extra=_block(9, rows=4))
    assert 4 * 32 * 4 > BLOCK_BYTES * EXTRA_KEPT_ALIVE
    cache.keep(received, arrived)
    assert not _inside(cache["a"], data) and torch.equal(cache["a"], arrived["a"])


def test_a_message_in_a_reusable_buffer_is_copied_from() -> None:
    cache = OperandBlocks(10 * BLOCK_BYTES)
    received, arrived, data = _message([("a", _block(1))])
    buffer = bytearray(data)
    frame = decode_frame(buffer)
    reused = Received(message=cast(Any, None), frame=frame)
    cache.keep(reused, decode_tensors(frame.header["tensors"], frame.payload))
    buffer[:] = bytes(len(buffer))
    assert torch.equal(cache["a"], arrived["a"])


def test_a_block_let_go_at_once_does_not_leave_its_sibling_a_view() -> None:
    cache = OperandBlocks(2 * BLOCK_BYTES + 1)
    received, arrived, data = _message([("a", _block(1)), ("big", _block(2, rows=64))])
    cache.keep(received, arrived)  # a goes as soon as big is in
    assert list(cache) == ["big"] and not _inside(cache["big"], data)
    assert torch.equal(cache["big"], arrived["big"])


def test_random_use_keeps_the_mirrors_order_and_the_memory_within_the_budget() -> None:
    rng = random.Random(7)
    budget = 6 * BLOCK_BYTES
    cache, mirror = OperandBlocks(budget), BlockCache(budget, int)
    contents = {f"k{i}": _block(i, rows=rng.choice((8, 32, 64))) for i in range(24)}
    messages: list[bytes] = []
    for _ in range(300):
        names = rng.sample(sorted(contents), rng.choice((1, 2, 3)))
        blocks = [(k, None if k in cache else contents[k]) for k in names]
        extra = _block(99, rows=rng.choice((1, 16))) if rng.random() < 0.2 else None
        received, arrived, data = _message(blocks, extra)
        messages.append(data)
        cache.keep(received, arrived)
        # As the coordinator's mirror records a task: the blocks sent, then those referred to.
        order = [b for b in blocks if b[1] is not None] + [b for b in blocks if b[1] is None]
        mirror.record((k, None if t is None else t.nbytes) for k, t in order)
        assert list(cache) == list(mirror) and cache.bytes == mirror.bytes
        assert all(torch.equal(cache[k], contents[k]) for k in cache)
        # What the cache keeps alive: each message its views are into, once, and the
        # blocks it copied.
        alive: dict[int, int] = {}
        for k in cache:
            into = [i for i, m in enumerate(messages) if _inside(cache[k], m)]
            if into:
                alive[into[0]] = len(messages[into[0]])
            else:
                alive[-len(alive) - 1] = cache[k].nbytes
        header_room = 3 * 4096  # a frame's header and its alignment, per message
        assert sum(alive.values()) <= budget * (1 + EXTRA_KEPT_ALIVE) + header_room
