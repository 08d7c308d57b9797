"""Where the coordinator's CPU goes: seconds of thread CPU time by the work they bought.

The data path's stages run on different threads (cutting and signing on the training
thread, the network on the event loop, decoding, checking and assembly on the check
thread, commits on the ledger thread), so a step's cost breakdown is each stage's own
CPU time, measured on the thread that did it, plus each thread's total: what a thread
spent beyond its named stages is the rest of its work (the training thread's non-GEMM
ops and optimizer, the event loop's framing, sending, receiving and scheduling).

CPU time, not wall time: on shared cores a stage that waits for a core costs nothing,
and the figures add up to what the coordinator took from the machine.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def thread_cpu_seconds(native_id: int) -> float | None:
    """CPU seconds a thread (by its OS thread id) has used so far; None where the
    platform cannot say or the thread has ended.

    Linux names a thread's CPU clock by its thread id (the kernel's CPUCLOCK encoding,
    as glibc builds it): unlike ``pthread_getcpuclockid``, which reads the thread's
    pthread structure and may touch freed memory once the thread has ended, a stale id
    only gets EINVAL.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        return time.clock_gettime((~native_id << 3) | _PER_THREAD | _SCHED_CLOCK)
    except OSError:
        return None


_PER_THREAD = 4  # CPUCLOCK_PERTHREAD_MASK
_SCHED_CLOCK = 2  # CPUCLOCK_SCHED: all the CPU time the thread was scheduled for


class CpuCosts:
    """Stage totals, added to from any thread; ``clock`` is the calling thread's CPU
    clock (injected in tests)."""

    def __init__(self, clock: Callable[[], float] = time.thread_time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._stages: dict[str, float] = {}
        # OS thread id -> (role, the thread): Python's join() returns a moment before
        # the OS thread is gone, so whether it has ended is the thread object's word,
        # which also keeps a reused id from being counted under the old role.
        self._threads: dict[int, tuple[str, threading.Thread]] = {}
        # Bytes a stage passed over (the blocks cut and hashed): what its seconds bought.
        self._bytes: dict[str, int] = {}

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            self.add(stage, self._clock() - start)

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._stages[stage] = self._stages.get(stage, 0.0) + seconds

    def add_bytes(self, stage: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[stage] = self._bytes.get(stage, 0) + nbytes

    def bytes_so_far(self, stage: str) -> int:
        with self._lock:
            return self._bytes.get(stage, 0)

    def this_thread_is(self, role: str) -> None:
        """Report the calling thread's whole CPU time as ``thread:<role>``."""
        with self._lock:
            self._threads[threading.get_native_id()] = (
                f"thread:{role}",
                threading.current_thread(),
            )

    def snapshot(self) -> dict[str, float]:
        """Stage totals so far, and each registered thread's CPU total by role (threads
        that have ended drop out)."""
        with self._lock:
            out = dict(self._stages)
            threads = list(self._threads.items())
        for native_id, (role, thread) in threads:
            seconds = thread_cpu_seconds(native_id) if thread.is_alive() else None
            if seconds is None:
                with self._lock:
                    self._threads.pop(native_id, None)
            else:
                out[role] = out.get(role, 0.0) + seconds
        return out


# Stages in which the coordinator multiplies tiles itself (its planned share, and tiles
# no worker could take): computing the step, not orchestrating it.
COMPUTING_STAGES = ("kept_tiles", "stranded_tiles")


def process_cpu_seconds() -> float:
    """CPU seconds this process has used so far, all its threads (not its children)."""
    return time.process_time()


def since(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What was spent between two snapshots, rounded for a log line."""
    return {k: round(v - before.get(k, 0.0), 4) for k, v in sorted(now.items())}


# One per process: the stages are spread over objects that never meet (each GEMM's
# tiles, the check thread, the server), and all of them are the coordinator's CPU.
COSTS = CpuCosts()
