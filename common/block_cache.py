"""The operand cache's bookkeeping, one implementation for both ends of a connection.

A worker keeps the operand blocks it was sent; the coordinator keeps a mirror of that
cache (block sizes only) to know which operands it may send by reference. The two agree
only if both apply the same rule in the same order, so both run this code: for each
task, its blocks in order (the ones sent first, then the ones referred to) become the
most recently used, new ones are added, and then the least recently used go until the
cache fits its budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)  # a block's name: its content id, on both ends
V = TypeVar("V")


class BlockCache(Mapping[K, V], Generic[K, V]):
    """Block id -> value (a tensor on the worker, its size at the coordinator), LRU."""

    def __init__(self, budget: int, size: Callable[[V], int]) -> None:
        self.budget = budget
        self._size = size
        self._blocks: OrderedDict[K, V] = OrderedDict()
        self.bytes = 0

    def __getitem__(self, block: K) -> V:
        return self._blocks[block]

    def __contains__(self, block: object) -> bool:
        # Mapping's own goes through __getitem__ and a KeyError per miss; the scheduler
        # asks this for every candidate worker of every tile.
        return block in self._blocks

    def holds_any(self, blocks: Iterable[K]) -> bool:
        """Whether any of ``blocks`` is held: one call where ``in`` for each is one per
        block (the scheduler asks it of every candidate worker of every tile)."""
        return not self._blocks.keys().isdisjoint(blocks)

    def __iter__(self) -> Iterator[K]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def keeps(self) -> bool:
        """Whether blocks are kept at all (a budget of 0: every operand is sent)."""
        return self.budget > 0

    def record(self, blocks: Iterable[tuple[K, V | None]]) -> list[K]:
        """One task's blocks, in order: a held one becomes the most recently used; a new
        one is added (its value given; None: it did not arrive, so nothing to keep).
        Returns the blocks let go to fit the budget, the least recently used first."""
        evicted: list[K] = []
        if not self.keeps:
            return evicted
        for block, value in blocks:
            if block in self._blocks:
                self._blocks.move_to_end(block)
            elif value is not None:
                self._blocks[block] = value
                self.bytes += self._size(value)
        while self.bytes > self.budget and self._blocks:
            block, value = self._blocks.popitem(last=False)
            self.bytes -= self._size(value)
            evicted.append(block)
        return evicted

    def replace(self, block: K, value: V) -> None:
        """A held block's value swapped for an equal one of the same size; its place in
        the order stays."""
        self._blocks[block] = value

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0
