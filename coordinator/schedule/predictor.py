"""What the scheduler asks of the caller's cost model. The scheduler keeps no clocks of
workers' speeds itself: the core answers from what each worker's tiles taught it, the
tests from hand-made tables."""

from __future__ import annotations

from typing import Protocol

from coordinator.schedule.records import TileTicket


class Predictor(Protocol):
    def prefers(self, worker_id: str, ticket: TileTicket) -> bool:
        """Whether ``worker_id`` should take ``ticket`` ahead of its turn (it already
        holds one of the tile's operand blocks, say)."""
        ...

    def keeps_blocks(self, worker_id: str) -> bool:
        """Whether ``worker_id`` keeps the operand blocks it is sent (an operand cache):
        only then does a tile that shares a block with its others cost fewer bytes."""
        ...

    def finish_at(self, worker_id: str, tile_id: str) -> float:
        """When ``worker_id`` will return ``tile_id``, which it holds (its queue and
        measured speed included)."""
        ...

    def run_time(self, worker_id: str, ticket: TileTicket) -> float:
        """Seconds from handing ``ticket`` to an idle ``worker_id`` until its result."""
        ...

    def busy_time(self, worker_id: str, ticket: TileTicket) -> float:
        """Seconds ``ticket`` adds behind a worker's other tiles: less than its run time
        where the worker overlaps transfers with compute."""
        ...
