"""The operands of the tiles a worker is sent: whether a tile fits this worker, what it
costs, and the operand blocks kept between tasks.

The coordinator keeps a mirror of this worker's blocks (block sizes only, the same
``BlockCache`` rule, budget and order) so that it may refer to an operand the worker
already holds instead of sending it again.
"""

from __future__ import annotations

import math

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


class OperandBlocks(BlockCache[torch.Tensor]):
    """Block id -> operand kept between tasks, least recently used first."""

    def __init__(self, budget: int) -> None:
        super().__init__(budget, _nbytes)

    def keep(self, received: Received, arrived: dict[str, torch.Tensor]) -> None:
        """Keep the operands of ``received`` that came under a block id, and mark the ones
        used from the cache as recently used: the same order the coordinator's mirror keeps."""
        if self.budget <= 0:
            return
        blocks = [
            desc[BLOCK_FIELD]
            for desc in received.frame.header.get("tensors", [])
            if isinstance(desc, dict) and isinstance(desc.get(BLOCK_FIELD), str)
        ]
        self.record(
            # A copy: a view would keep the whole frame (the other operand too) alive.
            (block, arrived[block].clone() if block in arrived and block not in self else None)
            for block in blocks
        )
