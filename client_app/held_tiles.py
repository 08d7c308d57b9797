"""The tiles a worker holds for its current connection: queued in arrival order, and the
one on the compute thread.

A GEMM in progress cannot be interrupted, so cancelling (or pausing on) the computing
tile marks its result to be discarded when it ends; from then on the tile is no longer
held, and the coordinator may hand it out again while it still runs.
"""

from __future__ import annotations

import enum
from collections import OrderedDict

from client_app.session_types import TileJob


class Finished(enum.Enum):
    """What became of a tile when the compute thread finished it."""

    WANTED = "wanted"  # its result goes to the coordinator
    DISCARDED = "discarded"  # cancelled (or paused on) while computing
    GONE = "gone"  # from a connection that has since been lost


class HeldTiles:
    def __init__(self) -> None:
        self._queue: OrderedDict[str, TileJob] = OrderedDict()
        self.computing: TileJob | None = None
        self._discard_computing = False

    def __len__(self) -> int:
        """Tiles held: queued + computing (unless its result will be discarded)."""
        return len(self._queue) + int(bool(self._live_computing_id()))

    def holds(self, tile_id: str) -> bool:
        return tile_id in self._queue or tile_id == self._live_computing_id()

    def add(self, job: TileJob) -> None:
        self._queue[job.tile_id] = job

    def take_next(self) -> TileJob | None:
        """The oldest queued tile, now computing; None if none or one is computing."""
        if self.computing is not None or not self._queue:
            return None
        _, job = self._queue.popitem(last=False)
        self.computing = job
        self._discard_computing = False
        return job

    def finish(self, job: TileJob) -> Finished:
        if job is not self.computing:
            return Finished.GONE
        self.computing = None
        if self._discard_computing:
            self._discard_computing = False
            return Finished.DISCARDED
        return Finished.WANTED

    def cancel_queued(self, tile_id: str) -> bool:
        """Drop ``tile_id`` if it is queued; False if it is not."""
        return self._queue.pop(tile_id, None) is not None

    def discard_computing(self, tile_id: str) -> bool:
        """Mark the computing tile's result to be discarded if it is ``tile_id``."""
        if self.computing is None or self.computing.tile_id != tile_id:
            return False
        self._discard_computing = True
        return True

    def drop_all(self) -> tuple[str, ...]:
        """Drop every tile (the computing one's result is discarded); their ids."""
        dropped = tuple(self._queue)
        if self.computing is not None:
            self._discard_computing = True
            dropped += (self.computing.tile_id,)
        self._queue.clear()
        return dropped

    def clear(self) -> None:
        """Forget every tile, the computing one too: finishing it later is GONE."""
        self._queue.clear()
        self.computing = None
        self._discard_computing = False

    def _live_computing_id(self) -> str:
        # A computing tile whose result will be discarded is no longer held: the
        # coordinator may already have handed the same tile back (after a resume).
        if self.computing is None or self._discard_computing:
            return ""
        return self.computing.tile_id
