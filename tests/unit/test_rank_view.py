"""One view of the coordinator ranks: each rank's summary of its own status, published
through a store and gathered by every rank, with the job's totals and how long ago each
rank was heard from."""

from __future__ import annotations

import asyncio
from typing import Any

import torch.distributed as dist

from coordinator.serve.rank_view import RankView, job_view, summary
from coordinator.step.ranks import Ranks


def _status(workers: int, verified: int, orch: float) -> dict[str, Any]:
    return {
        "state": "training",
        "step": 7,
        "workers": workers,
        "tiles_verified": verified,
        "last": {"step": 6, "seconds": 0.5, "orchestration_cpu_s": orch},
    }


def test_a_summary_holds_what_the_other_ranks_show_of_this_one() -> None:
    got = summary(1, "ws://h:8766/ws", _status(3, 40, 0.25), now=100.0)
    assert got == {
        "rank": 1,
        "url": "ws://h:8766/ws",
        "state": "training",
        "step": 7,
        "workers": 3,
        "tiles_verified": 40,
        "step_seconds": 0.5,
        "orchestration_cpu_s": 0.25,
        "published_at": 100.0,
    }
    assert summary(0, "u", {}, 1.0)["workers"] == 0  # before anything happened


def test_the_job_view_totals_the_ranks_heard_from_and_says_who_is_silent() -> None:
    heard = {
        0: summary(0, "a", _status(2, 10, 0.5), now=95.0),
        2: summary(2, "c", _status(1, 5, 0.25), now=99.0),
    }
    view = job_view(0, 3, heard, now=100.0)
    assert view["rank"] == {"rank": 0, "world": 3}
    assert [r["heard"] for r in view["ranks"]] == [True, False, True]
    assert [r.get("age_s") for r in view["ranks"]] == [5.0, None, 1.0]
    assert view["ranks_total"] == {
        "heard": 2,
        "workers": 3,
        "tiles_verified": 15,
        "orchestration_cpu_s": 0.75,
    }


def test_two_ranks_see_each_other_through_one_store() -> None:
    store = dist.HashStore()  # what the ranks met through, shared here in one process
    clock = [50.0]
    views = [
        RankView(
            Ranks(r, 2, store),
            f"ws://h:{8765 + r}/ws",
            lambda r=r: _status(r + 1, 10 * r, 0.1),
            lambda: clock[0],
        )
        for r in (0, 1)
    ]
    views[0].exchange(summary(0, views[0].url, _status(1, 0, 0.1), clock[0]))
    assert [r["heard"] for r in views[0].status()["ranks"]] == [True, False]  # 1 not yet
    clock[0] = 52.0
    views[1].exchange(summary(1, views[1].url, _status(2, 10, 0.1), clock[0]))
    views[0].exchange(summary(0, views[0].url, _status(1, 0, 0.1), clock[0]))
    for view in views:
        seen = view.status()
        assert [r["url"] for r in seen["ranks"]] == ["ws://h:8765/ws", "ws://h:8766/ws"]
        assert seen["ranks_total"]["workers"] == 3
    clock[0] = 60.0  # rank 1 stopped publishing: rank 0 shows how long ago it was heard
    assert views[0].status()["ranks"][1]["age_s"] == 8.0


def test_the_view_runs_on_a_period_and_stops_when_cancelled() -> None:
    store = dist.HashStore()
    view = RankView(Ranks(0, 1, store), "u", lambda: _status(1, 2, 0.1))

    async def run_briefly() -> None:
        task = asyncio.ensure_future(view.run())
        for _ in range(100):  # bounded: the first exchange runs at once
            await asyncio.sleep(0.02)
            if view.summaries:
                break
        task.cancel()

    asyncio.run(run_briefly())
    assert view.summaries[0]["tiles_verified"] == 2
