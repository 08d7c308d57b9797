"""The tiles a worker holds for its current connection: queued in arrival order, and
those handed to the compute thread (the one it multiplies, and any queued there behind it).

A GEMM handed to the compute thread cannot be recalled, so cancelling (or pausing on) a
computing tile marks its result to be discarded when it ends; from then on the tile is
no longer held, and the coordinator may hand it out again while it still runs (the
compute thread skips one it has not started: ``wanted``).
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
        # On the compute thread, in the order they run: the one multiplying, then those
        # queued behind it there (so that the next GEMM starts without waiting for the
        # event loop), each until its result is booked.
        self._computing: list[TileJob] = []
        # id() of the computing tiles, and of those whose result will be discarded: sets,
        # so that the compute thread's ``wanted`` is one atomic look-up in each.
        self._computing_ids: set[int] = set()
        self._discarded: set[int] = set()

    def __len__(self) -> int:
        """Tiles held: queued + computing (but those whose result will be discarded)."""
        return len(self._queue) + len(self._live_computing())

    @property
    def computing(self) -> TileJob | None:
        """The computing tile that runs first (None if none)."""
        return self._computing[0] if self._computing else None

    def holds(self, tile_id: str) -> bool:
        return tile_id in self._queue or any(j.tile_id == tile_id for j in self._live_computing())

    def wanted(self, job: TileJob) -> bool:
        """Whether ``job``, handed to the compute thread, still has a result to send.
        Safe from the compute thread: a tile only ever goes from wanted to not wanted."""
        return id(job) in self._computing_ids and id(job) not in self._discarded

    def add(self, job: TileJob) -> None:
        self._queue[job.tile_id] = job

    def take_next(self, depth: int = 1) -> TileJob | None:
        """The oldest queued tile, now computing; None if none, or if ``depth`` tiles
        are computing already."""
        if len(self._computing) >= depth or not self._queue:
            return None
        _, job = self._queue.popitem(last=False)
        self._computing.append(job)
        self._computing_ids.add(id(job))
        return job

    def finish(self, job: TileJob) -> Finished:
        for i, computing in enumerate(self._computing):
            if computing is job:
                del self._computing[i]
                self._computing_ids.discard(id(job))
                if id(job) in self._discarded:
                    self._discarded.discard(id(job))
                    return Finished.DISCARDED
                return Finished.WANTED
        return Finished.GONE

    def cancel_queued(self, tile_id: str) -> bool:
        """Drop ``tile_id`` if it is queued; False if it is not."""
        return self._queue.pop(tile_id, None) is not None

    def discard_computing(self, tile_id: str) -> bool:
        """Mark the result of the computing tile ``tile_id`` to be discarded; False if no
        computing tile (whose result is still wanted) is ``tile_id``."""
        for job in self._live_computing():
            if job.tile_id == tile_id:
                self._discarded.add(id(job))
                return True
        return False

    def drop_all(self) -> tuple[str, ...]:
        """Drop every tile (the computing ones' results are discarded); their ids."""
        dropped = tuple(self._queue)
        live = self._live_computing()
        self._discarded.update(id(job) for job in live)
        dropped += tuple(job.tile_id for job in live)
        self._queue.clear()
        return dropped

    def clear(self) -> None:
        """Forget every tile, the computing ones too: finishing them later is GONE."""
        self._queue.clear()
        self._computing.clear()
        self._computing_ids.clear()
        self._discarded.clear()

    def _live_computing(self) -> list[TileJob]:
        # A computing tile whose result will be discarded is no longer held: the
        # coordinator may already have handed the same tile back (after a resume).
        return [job for job in self._computing if id(job) not in self._discarded]
