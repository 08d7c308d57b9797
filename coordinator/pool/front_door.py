"""The front door of a job with several coordinator ranks: which rank a joining worker
should serve.

Workers may all be given one rank's URL. A rank that has more workers than another
rank that is up sends a joining worker on (its signed welcome names the other rank's
URL: ``Welcome.serve_at``); the worker then joins that rank saying it was sent
(``Hello.directed``) and is never sent on again, so no worker bounces between ranks.
The ranks' loads come from the view they share (``coordinator.serve.rank_view``), which
is a few seconds old: the workers this rank sent to a rank since that rank last
published are counted as its, so a burst of joins is spread rather than all sent to the
rank that was emptiest a moment ago. Pure: time is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from coordinator.step.run_state import RunState

# A rank not heard from for this long may be gone: nobody is sent there.
FRESH_S = 10.0
# What a rank that takes no more workers says its state is (a starting rank listens).
CLOSED_STATES = frozenset(state.value for state in RunState if state.closed)


@dataclass(frozen=True)
class RankLoad:
    """One other rank as last heard: where workers reach it and how many it has."""

    rank: int
    url: str
    workers: int
    state: str
    published_at: float  # when it said so (the view's clock)


@dataclass(frozen=True)
class Direction:
    rank: int
    url: str


@dataclass
class FrontDoor:
    """Which rank a joining worker serves; remembers whom it sent where."""

    rank: int
    # (rank, when) of each worker this rank sent on, kept while it may be uncounted.
    _sent: list[tuple[int, float]] = field(default_factory=list)

    def direct(self, my_workers: int, others: Iterable[RankLoad], now: float) -> Direction | None:
        """Where a joining worker should go, or None to keep it here.

        ``my_workers``: the workers this rank has now, before this one."""
        self._sent = [(r, t) for r, t in self._sent if now - t < 2 * FRESH_S]
        best: tuple[int, int, RankLoad] | None = None
        for other in others:
            if other.rank == self.rank or other.state in CLOSED_STATES or not other.url:
                continue
            if now - other.published_at > FRESH_S:
                continue
            unseen = sum(1 for r, t in self._sent if r == other.rank and t >= other.published_at)
            load = other.workers + unseen
            if best is None or (load, other.rank) < best[:2]:
                best = (load, other.rank, other)
        if best is None or best[0] >= my_workers:
            return None  # ties stay: a worker moves only to a rank with fewer
        self._sent.append((best[2].rank, now))
        return Direction(best[2].rank, best[2].url)
