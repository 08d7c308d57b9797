"""The operand blocks a training step has cut so far, by the memory they were cut from:
a later GEMM of the step that cuts the same block of the same matrix again takes its
content id (and, while the first block is still in use, its bytes) instead of copying
and hashing it once more.

A step reads every GEMM operand twice (a weight in its forward and its input gradient,
an input in its forward and its weight gradient, an output gradient in both
gradients), and where the planner cuts the two reads alike (``coordinator.plan.layouts``)
the second read's blocks are the first's.

A wrong id is not harmless here: the coordinator would name to a worker a block it holds
with other bytes, and check the result against the bytes it holds now. So a block is
named by the memory it lies in and that memory's version (which every in-place torch op
moves on), and a name holds only while the tensor that owns the memory (the block's
base) is alive, as that object: while it is, no other matrix can be given that memory.
What moves no version is a write past torch's ops (through ``.data``, or a numpy view),
which user code may do between the GEMMs of an eager step but not in a traced step's
graph, whose ops are torch's own; the offload uses this for traced steps only.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from common.tensors import Block, encode_block, stored_layout

# Names kept at most: the blocks of a few hundred GEMMs; past it the oldest is let go.
MAX_BLOCKS = 8192


@dataclass(frozen=True)
class _Cut:
    owner: weakref.ReferenceType[torch.Tensor]  # the tensor the block's memory belongs to
    block_id: str
    block: weakref.ReferenceType[Block]  # the block as laid out, while something uses it


class StepBlocks:
    """``encode_block`` for one step's operand blocks, each copied and hashed once.

    Training thread only."""

    def __init__(self, limit: int = MAX_BLOCKS) -> None:
        self._limit = limit
        self._cuts: dict[Hashable, _Cut] = {}

    def __len__(self) -> int:
        return len(self._cuts)

    def encode(self, view: torch.Tensor) -> tuple[Block, bool]:
        """``view`` (a block of a GEMM operand) as ``encode_block(view, share=True)``
        lays it out, and whether it was cut afresh (False: its id, and maybe its bytes,
        are an earlier cut's)."""
        name = memory_name(view)
        owner = _owner(view)
        cut = self._cuts.get(name) if name is not None else None
        if cut is not None and cut.owner() is owner:
            transposed = stored_layout(view)[1]
            earlier = cut.block()
            if earlier is not None:
                if earlier.transposed == transposed:
                    return earlier, False
                # The same bytes read the other way round: the same content id.
                return Block(earlier.tensor.mT, earlier.data, earlier.id, transposed), False
            return encode_block(view, cut.block_id, share=True), False
        block = encode_block(view, share=True)
        if name is not None:
            self._keep(name, owner, block)
        return block, True

    def _keep(self, name: Hashable, owner: torch.Tensor, block: Block) -> None:
        self._cuts.pop(name, None)
        while len(self._cuts) >= self._limit:
            del self._cuts[next(iter(self._cuts))]
        self._cuts[name] = _Cut(weakref.ref(owner), block.id, weakref.ref(block))


def _owner(view: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``view`` lies in (a view's base)."""
    base = view._base
    return view if base is None else base


def memory_name(t: torch.Tensor) -> Hashable | None:
    """The memory ``t``'s bytes lie in (where, their shape and strides as they lie) and
    its version, which an in-place change moves on: the same for every view of those
    bytes, whichever way round it reads them. None for a tensor without a version (made
    in inference mode)."""
    try:
        version = t._version
    except RuntimeError:
        return None
    stored, _ = stored_layout(t)
    return (
        stored.device,
        stored.data_ptr(),
        tuple(stored.shape),
        stored.stride(),
        stored.dtype,
        version,
    )
