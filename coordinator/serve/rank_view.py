"""One view of a job's coordinator ranks, from any rank.

Every few seconds each rank writes a summary of its own status (its address, state,
step, workers, verified tiles, last step's time and orchestration CPU) under a key of
its own in the store the ranks met through, and reads the others'. ``/api/status``,
the dashboard and ``/metrics`` of every rank then show every rank and the job's totals,
without a rank ever calling another's HTTP endpoint. The store calls block, so they run
on a worker thread, never on the event loop; a rank that stops publishing shows how
long ago it was last heard from.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from coordinator.pool.front_door import RankLoad
from coordinator.step.ranks import Ranks

log = logging.getLogger("cleave.coordinator")

PERIOD_S = 2.0


def summary(rank: int, url: str, own: Mapping[str, Any], now: float) -> dict[str, Any]:
    """What one rank tells the others about itself. ``own``: its ``state``, ``step``,
    ``workers`` (how many), ``tiles_verified`` and ``last`` (its last step's record)."""
    last = own.get("last") or {}
    return {
        "rank": rank,
        "url": url,
        "state": own.get("state"),
        "step": own.get("step"),
        "workers": int(own.get("workers") or 0),
        "tiles_verified": own.get("tiles_verified"),
        "step_seconds": last.get("seconds"),
        "orchestration_cpu_s": last.get("orchestration_cpu_s"),
        "published_at": now,
    }


def job_view(
    rank: int, world: int, summaries: Mapping[int, Mapping[str, Any]], now: float
) -> dict[str, Any]:
    """The ``rank``/``ranks``/``ranks_total`` part of a rank's status: every rank's summary as
    last heard (with its age), and the job's totals over the ranks heard from."""
    ranks = []
    for r in range(world):
        known = summaries.get(r)
        if known is None:
            ranks.append({"rank": r, "heard": False})
            continue
        entry = {k: v for k, v in known.items() if k != "published_at"}
        entry["heard"] = True
        entry["age_s"] = round(max(0.0, now - float(known["published_at"])), 1)
        ranks.append(entry)
    heard = [r for r in ranks if r["heard"]]
    return {
        "rank": {"rank": rank, "world": world},
        "ranks": ranks,
        "ranks_total": {
            "heard": len(heard),
            "workers": sum(int(r.get("workers") or 0) for r in heard),
            "tiles_verified": sum(int(r.get("tiles_verified") or 0) for r in heard),
            "orchestration_cpu_s": round(
                sum(float(r.get("orchestration_cpu_s") or 0.0) for r in heard), 4
            ),
        },
    }


class RankView:
    """Publishes this rank's summary and gathers the others', on a period."""

    def __init__(
        self,
        ranks: Ranks,
        url: str,
        own_status: Callable[[], Mapping[str, Any]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        if ranks.store is None:
            raise ValueError("the ranks have no store to share their view through")
        self.ranks = ranks
        self.store = ranks.store
        self.url = url
        self.own_status = own_status
        self.clock = clock  # wall time: ranks on different hosts compare it
        self.summaries: dict[int, dict[str, Any]] = {}
        self._failing = False

    def status(self) -> dict[str, Any]:
        """This rank's part of ``/api/status`` (any thread)."""
        return job_view(self.ranks.rank, self.ranks.world, dict(self.summaries), self.clock())

    def loads(self) -> list[RankLoad]:
        """The other ranks as last heard, for the front door."""
        return [
            RankLoad(
                rank=int(known["rank"]),
                url=str(known.get("url") or ""),
                workers=int(known.get("workers") or 0),
                state=str(known.get("state") or ""),
                published_at=float(known["published_at"]),
            )
            for r, known in dict(self.summaries).items()
            if r != self.ranks.rank
        ]

    async def run(self) -> None:
        """Publish and gather every ``PERIOD_S`` until cancelled."""
        while True:
            mine = summary(self.ranks.rank, self.url, self.own_status(), self.clock())
            await asyncio.to_thread(self.exchange, mine)
            await asyncio.sleep(PERIOD_S)

    def exchange(self, mine: dict[str, Any]) -> None:
        """Write ``mine`` and read the others' (blocking: a worker thread)."""
        gathered = {self.ranks.rank: mine}
        try:
            self.store.set(_key(self.ranks.rank), json.dumps(mine))
            for r in range(self.ranks.world):
                if r != self.ranks.rank and self.store.check([_key(r)]):
                    gathered[r] = json.loads(self.store.get(_key(r)))
        except (RuntimeError, ValueError) as exc:  # a rank's store gone at the end
            if not self._failing:
                log.info("the other ranks' status could not be read: %s", exc)
            self._failing = True
            gathered = {**self.summaries, self.ranks.rank: mine}
        else:
            self._failing = False
        self.summaries = gathered


def _key(rank: int) -> str:
    return f"cleave/view/rank-{rank}"
