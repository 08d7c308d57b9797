"""The C allocator's set-up for long-running processes, each case in a process of its
own (it changes process-wide state that other tests must not inherit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Buffers of a few sizes made and freed in turn, as a step's frames, blocks and outputs
# are; the page faults of each round are counted (a fault is a page fresh from the
# kernel). The sizes are below the mmap threshold the policy sets.
PROBE = """
import json, resource, sys, torch
torch.set_num_threads(1)
from common.malloc_policy import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "1" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds = []
for _ in range(4):
    before = faults()
    for size in (3 << 20, 8 << 20, 1 << 20, 12 << 20):
        buffers = [torch.ones(size, dtype=torch.uint8) for _ in range(4)]
        del buffers
    rounds.append(faults() - before)
print(json.dumps({"kept": kept, "rounds": rounds}))
"""


def _faults_by_round(policy: bool) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "1" if policy else "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_buffers_made_again_reuse_the_memory_freed_before() -> None:
    default = _faults_by_round(policy=False)
    rounds = default["rounds"]
    assert isinstance(rounds, list)
    if sum(rounds[1:]) < 1000:
        pytest.skip("this C library keeps freed memory by default: nothing to compare")
    kept = _faults_by_round(policy=True)
    assert kept["kept"] is True
    later = kept["rounds"]
    assert isinstance(later, list)
    # After the first round the buffers are made of memory freed before: few fresh
    # pages (where the interpreter's own allocations split the free memory, a buffer
    # may not fit in what is left and the heap grows once more).
    assert sum(later[1:]) < sum(rounds[1:]) / 4, (rounds, later)
