"""Freed heap memory is kept for the next buffers rather than given back at ``free``;
it goes back to the system between training steps, once it is large (larger than a
bound and than the memory the heap has in use) and the heap has grown since it last
went back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from coordinator.step import heap as heap_module
from coordinator.step.heap import StepTrims, heap_bytes, release_free_memory, trim_due

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")


def _fragmented() -> list[bytearray]:
    """256 MiB of small blocks (from the heap, not mmap), all but every 16th freed: the
    free ones are pinned below blocks in use, where the heap cannot shrink by itself."""
    blocks = [bytearray(64 << 10) for _ in range(4096)]  # every page touched
    return blocks[::16]


def test_free_memory_between_blocks_still_in_use_goes_back_to_the_system() -> None:
    kept = _fragmented()
    process = psutil.Process()
    before = process.memory_info().rss
    assert release_free_memory(above_bytes=0, up_to_in_use=False)
    released = before - process.memory_info().rss
    assert released > 128 << 20, f"only {released >> 20} MiB went back"
    assert len(kept) == 256


def test_the_heap_is_left_alone_while_its_free_memory_is_under_the_bound() -> None:
    kept = _fragmented()
    heap = heap_bytes()
    assert heap is not None
    free = heap[0]
    assert free > 128 << 20
    process = psutil.Process()
    before = process.memory_info().rss
    assert not release_free_memory(above_bytes=free + (64 << 20), up_to_in_use=False)
    assert process.memory_info().rss > before - (32 << 20)  # nothing handed back
    assert release_free_memory(above_bytes=free // 2, up_to_in_use=False)
    assert len(kept) == 256


@pytest.mark.parametrize(
    ("free", "in_use", "up_to_in_use", "trimmed_at", "due"),
    [
        (100, 1000, True, 0, False),  # under the bound
        (300, 1000, True, 0, False),  # over the bound, but a step's worth beside what is in use
        (1000, 1000, True, 0, False),
        (1001, 1000, True, 0, True),  # more free than in use: trimmed
        (300, 1000, False, 0, True),  # the bound alone
        (200, 100, False, 0, False),
        (1001, 1000, True, 2001, False),  # no larger than at the last trim
        (1500, 1000, True, 2001, False),  # grown, but by less than TRIM_GROWTH
        (1600, 1000, True, 2001, True),  # grown by more
        (400, 1000, False, 2001, False),
    ],
)
def test_a_heap_is_trimmed_once_more_is_free_than_the_bound_and_than_is_in_use_and_it_grew(
    free: int, in_use: int, up_to_in_use: bool, trimmed_at: int, due: bool
) -> None:
    assert (
        trim_due(free, in_use, above_bytes=256, up_to_in_use=up_to_in_use, trimmed_at=trimmed_at)
        is due
    )


def test_steps_that_free_as_much_as_the_last_are_not_trimmed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trimmed free chunk still counts as free, so a step that used the memory the last
    trim handed back leaves the heap as it found it: trimming it again would only hand
    back the pages the next step faults in once more."""
    mib = 1 << 20
    steps = [(400, 300), (380, 310), (420, 300), (700, 320), (690, 330), (300, 900)]
    heaps = iter([(free * mib, in_use * mib) for free, in_use in steps])
    monkeypatch.setattr(heap_module, "heap_bytes", lambda: next(heaps))
    monkeypatch.setattr(heap_module, "_trim", lambda: True)
    trims = StepTrims()
    assert [trims.after_step() for _ in steps] == [True, False, False, True, False, False]


ROOT = Path(__file__).resolve().parents[2]

# Buffers of a few sizes made and freed in turn, as a step's frames, blocks and outputs
# are; the page faults of each round are counted (a fault is a page fresh from the
# kernel). argv: whether the policy is set, the sizes in MiB, whether they are made on a
# thread other than the main one (as the training and the checks make theirs).
PROBE = """
import json, resource, sys, threading, torch
torch.set_num_threads(1)
from coordinator.step.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "1" else None
sizes = [int(mib) << 20 for mib in sys.argv[2].split(",")]
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds = []
def run():
    for _ in range(8):
        before = faults()
        for size in sizes:
            buffers = [torch.ones(size, dtype=torch.uint8) for _ in range(4)]
            del buffers
        rounds.append(faults() - before)
if sys.argv[3] == "1":
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
else:
    run()
print(json.dumps({"kept": kept, "rounds": rounds}))
"""


SETTLED = 4  # rounds the heap may take to grow to fit the probe's buffers


def _faults_by_round(policy: bool, sizes_mib: str, on_thread: bool) -> dict[str, object]:
    """The probe in a process of its own: the policy is process-wide, and other tests
    must not inherit it."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "1" if policy else "0", sizes_mib, "1" if on_thread else "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("sizes_mib", "on_thread"),
    [
        # 40 MiB is above any mmap threshold glibc takes.
        ("3,40,1,12", False),
        # And larger than a thread's own heap can hold: a wide model's activations, made
        # on the training thread.
        ("48,130", True),
    ],
)
def test_buffers_made_again_reuse_the_memory_freed_before(sizes_mib: str, on_thread: bool) -> None:
    default = _faults_by_round(policy=False, sizes_mib=sizes_mib, on_thread=on_thread)
    rounds = default["rounds"]
    assert isinstance(rounds, list)
    if sum(rounds[SETTLED:]) < 1000:
        pytest.skip("this C library keeps freed memory by default: nothing to compare")
    kept = _faults_by_round(policy=True, sizes_mib=sizes_mib, on_thread=on_thread)
    assert kept["kept"] is True
    later = kept["rounds"]
    assert isinstance(later, list)
    # Once the heap has grown to fit the rounds, the buffers are made of memory freed
    # before: few fresh pages. Small allocations of the interpreter and torch between
    # the large buffers split the free memory, so the heap takes up to four rounds to
    # grow to a size that fits them all.
    assert sum(later[SETTLED:]) < sum(rounds[SETTLED:]) / 4, (rounds, later)
