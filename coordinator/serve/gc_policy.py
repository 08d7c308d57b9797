"""How a long-running coordinator process sets up Python's garbage collector.

A full collection walks every tracked object and holds the GIL while it does: with a
thousand workers connected that is a pause of hundreds of milliseconds on the event
loop, which heartbeats and results wait behind (``bench/bench_load.py`` shows it in its
heartbeat p99 and event-loop lag rows). Two things keep full collections rare and small:

- what is alive once the coordinator listens (modules, the job, its model) lives for
  the whole run, so it is frozen out of every later collection;
- the youngest generation is large enough to hold what the tiles in flight allocate
  (tickets, frames, futures), so those die young, by reference counting, instead of
  surviving two young collections into the old generation, whose growth is what
  triggers a full collection.

Only the coordinator's process entry calls this: in tests, many servers share one
process, and freezing would keep their cyclic garbage for good.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000  # allocations between young collections (Python's default: 700)


def settle_after_start() -> None:
    """Freeze what is alive now and widen the young generation (see the module)."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
