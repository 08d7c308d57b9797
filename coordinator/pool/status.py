"""The core's state as the status JSON shows it (``/api/status``, the dashboard)."""

from __future__ import annotations

import heapq
import operator
from typing import Any

from common.signing import fingerprint
from coordinator.pool.core_api import CoreApi
from coordinator.pool.workers import Worker

# Rows of the status's worker and ledger lists. A page (and a metrics scrape) of a pool
# of thousands is built on the event loop every second a dashboard is open: it lists the
# workers with the most tiles this session and the keys with the most FLOPs credited,
# and counts them all ("pool").
STATUS_ROWS = 200


def _listed(workers: dict[str, Worker]) -> list[Worker]:
    """At most ``STATUS_ROWS`` workers, the busiest this session, in the order they joined."""
    if len(workers) <= STATUS_ROWS:
        return list(workers.values())
    busiest = heapq.nlargest(
        STATUS_ROWS, workers.values(), key=operator.attrgetter("tiles_session")
    )
    chosen = {id(worker) for worker in busiest}
    return [worker for worker in workers.values() if id(worker) in chosen]


def core_status(core: CoreApi, now: float) -> dict[str, Any]:
    workers = []
    for worker in _listed(core.workers):
        standing = core.ledger.get(worker.key)
        workers.append(
            {
                "id": worker.worker_id,
                "key": worker.fingerprint,
                "name": worker.name,
                "state": worker.state.value,
                "reason": worker.reason,
                "device": worker.profile.device_name or worker.profile.device,
                "threads": worker.profile.threads,
                "gflops": worker.profile.gflops,
                # What its tiles show, which may differ from what it measured at start.
                "gflops_observed": round(worker.estimate.flops_per_s / 1e9, 2)
                if worker.estimate is not None
                else 0.0,
                "connected_s": round(now - worker.connected_at, 1),
                "last_seen_s": round(now - worker.last_seen, 1),
                "in_flight": len(core.scheduler.in_flight(worker.worker_id)),
                "tiles_session": worker.tiles_session,
                "refused": worker.refused,
                "reputation": round(standing.reputation, 4),
                "contribution": standing.to_json(),
            }
        )
    counters = core.counters
    keys, key_count = core.ledger.top(STATUS_ROWS)
    return {
        "coordinator_key": fingerprint(core.key),
        "pool": {
            "connected": len(core.workers),
            "active": core.active_workers(),
            "ledger_keys": key_count,
        },
        "workers": workers,
        "ledger": {c.key_fingerprint: c.to_json() for c in keys},
        "banned": [
            {"key": c.key_fingerprint, "name": c.name, "reason": c.banned_reason}
            for c in core.ledger.banned()
        ],
        "tiles": {
            "sent": counters.tiles_sent,
            "verified": counters.tiles_verified,
            "reissued": counters.reissued,
            "speculated": counters.speculated,
            "rejected": counters.rejected,
            "refused": counters.refused,
            "duplicates": counters.duplicates,
            "not_assigned": counters.not_assigned,
            "computed_here": counters.computed_here,
            "kept_here": counters.kept_here,
            "queued": core.scheduler.queued_count(),
            "pending": core.scheduler.pending(),
        },
        "traffic": {
            "bytes_down": counters.bytes_down,
            "bytes_down_uncached": counters.bytes_down_uncached,
            "bytes_up": counters.bytes_up,
            "bytes_half": counters.bytes_half,
        },
    }
