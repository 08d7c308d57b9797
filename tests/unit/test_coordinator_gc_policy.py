"""The coordinator process's garbage-collector set-up, in a process of its own (it
changes process-wide state that other tests must not inherit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import gc, json
from coordinator.serve.gc_policy import YOUNG_THRESHOLD, settle_after_start
alive = [[i] for i in range(1000)]
settle_after_start()
walked = {id(o) for o in gc.get_objects()}  # what a full collection walks
later = [[i] for i in range(10)]
print(json.dumps({
    "alive_walked": sum(id(x) in walked for x in alive),
    "later_walked": sum(id(x) in {id(o) for o in gc.get_objects()} for x in later),
    "threshold": gc.get_threshold(),
    "young": YOUNG_THRESHOLD,
}))
"""


def test_settling_freezes_what_is_alive_and_widens_the_young_generation() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["alive_walked"] == 0  # frozen: out of every later collection
    assert got["later_walked"] == 10  # what comes after is collected as before
    assert got["threshold"][0] == got["young"] > 700
