"""What a tile computes: the op whitelist, so a worker computes nothing else."""

from __future__ import annotations

from enum import Enum


class TileOp(str, Enum):
    MM = "mm"  # c = a @ b, 2-D
    BMM = "bmm"  # batched, 3-D

    def __str__(self) -> str:
        return self.value


TILE_OPS = tuple(op.value for op in TileOp)
