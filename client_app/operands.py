"""The operands of the tiles a worker is sent: whether a tile fits this worker, what it
costs, and the operand blocks kept between tasks.

The coordinator keeps a mirror of this worker's blocks (block sizes only, the same
``BlockCache`` rule, budget and order) so that it may refer to an operand the worker
already holds instead of sending it again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from common.block_cache import BlockCache
from common.errors import LimitExceeded
from common.messages import BLOCK_FIELD, Received

# Room for a result frame's header next to its tensor bytes (a few hundred bytes in
# practice; generous so a long tile id never tips a frame over the coordinator's limit).
RESULT_HEADER_ALLOWANCE = 4096


def check_fits(a: torch.Tensor, b: torch.Tensor, mem_cap_bytes: int, max_frame_bytes: int) -> None:
    """Raise LimitExceeded if the tile ``a @ b`` needs more memory than this worker's
    cap (0: none), or its result would not fit the coordinator's frame limit."""
    out_bytes = math.prod(a.shape[:-1]) * b.shape[-1] * a.element_size()
    need = a.nbytes + b.nbytes + out_bytes
    if mem_cap_bytes and need > mem_cap_bytes:
        raise LimitExceeded(
            f"tile needs {need} bytes (operands + result), over this worker's "
            f"mem_cap_bytes={mem_cap_bytes}"
        )
    if out_bytes + RESULT_HEADER_ALLOWANCE > max_frame_bytes:
        raise LimitExceeded(
            f"result of {out_bytes} bytes would not fit the coordinator's "
            f"max_frame_bytes={max_frame_bytes}"
        )


def tile_flop(a: torch.Tensor, b: torch.Tensor) -> int:
    # a: [.., m, k], b: [.., k, n] -> 2 m k n flops per batch entry
    return 2 * a.numel() * b.shape[-1]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.nbytes


class OperandBlocks(BlockCache[str, torch.Tensor]):
    """Block id -> operand kept between tasks, least recently used first.

    A block is kept as the view of the received message it arrived in, not a copy, when
    the blocks kept from that message are nearly all of its bytes. A view keeps the
    whole message alive, so when one of its blocks is let go while others stay, those
    are copied then, and the message's memory is freed: the cache never holds much more
    than its budget, and the order and sizes stay those the coordinator's mirror keeps.
    """

    def __init__(self, budget: int) -> None:
        super().__init__(budget, _nbytes)
        # The blocks kept as views of one message, by the message's id (unique while
        # they keep it alive), and each such block's message.
        self._viewing: dict[int, list[str]] = {}
        self._message_of: dict[str, int] = {}

    def keep(self, received: Received, arrived: dict[str, torch.Tensor]) -> None:
        """Keep the operands of ``received`` that came under a block id, and mark the ones
        used from the cache as recently used: the same order the coordinator's mirror keeps."""
        if not self.keeps:
            return
        blocks = [
            desc[BLOCK_FIELD]
            for desc in received.frame.header.get("tensors", [])
            if isinstance(desc, dict) and isinstance(desc.get(BLOCK_FIELD), str)
        ]
        new = {block: arrived[block] for block in blocks if block in arrived and block not in self}
        message = received.frame.payload.obj
        as_views = _mostly(new.values(), message)
        if not as_views:
            new = {block: tensor.clone() for block, tensor in new.items()}
        evicted = self.record((block, new.get(block)) for block in blocks)
        if as_views and new:
            kept = [block for block in new if block in self]
            if len(kept) == len(new):
                self._viewing[id(message)] = kept
                self._message_of.update(dict.fromkeys(kept, id(message)))
            else:  # one went at once: the message must not stay alive for the others
                for block in kept:
                    self.replace(block, self[block].clone())
        for block in evicted:
            self._let_go(block)

    def _let_go(self, block: str) -> None:
        message = self._message_of.pop(block, None)
        if message is None:
            return
        others = self._viewing.pop(message)
        others.remove(block)
        for other in others:
            del self._message_of[other]
            if other in self:  # copied, so that the message's memory goes now
                self.replace(other, self[other].clone())

    def clear(self) -> None:
        super().clear()
        self._viewing.clear()
        self._message_of.clear()


# A message's bytes beyond the blocks kept from it, at most this fraction of them, may
# stay alive with those blocks (its header, the alignment between them).
EXTRA_KEPT_ALIVE = 1 / 16


def _mostly(tensors: Iterable[torch.Tensor], message: object) -> bool:
    """Whether ``tensors`` are nearly all of ``message``'s bytes, and those bytes can
    never change (a buffer its owner may reuse is copied from)."""
    if not isinstance(message, bytes):
        return False
    kept = sum(t.nbytes for t in tensors)
    return kept > 0 and len(message) - kept <= kept * EXTRA_KEPT_ALIVE
