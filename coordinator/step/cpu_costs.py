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
from collections.abc import Callable


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
    clock (injected in tests).

    Each thread adds to totals of its own, without a lock: the cutting threads time
    every tile's copy and signature, and a lock they all took cost more than the clock
    reads once they contended for it. ``snapshot`` sums them."""

    def __init__(self, clock: Callable[[], float] = time.thread_time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._local = threading.local()
        # Every thread's own stage totals (kept when the thread ends: they were spent).
        self._totals: list[dict[str, float]] = []
        # OS thread id -> (role, the thread): Python's join() returns a moment before
        # the OS thread is gone, so whether it has ended is the thread object's word,
        # which also keeps a reused id from being counted under the old role.
        self._threads: dict[int, tuple[str, threading.Thread]] = {}
        # Bytes a stage passed over (the blocks cut and hashed): what its seconds bought.
        self._bytes: dict[str, int] = {}

    def timed(self, stage: str) -> _Timed:
        """``with costs.timed(stage):`` adds the block's CPU time to ``stage``, also when
        it raises."""
        return _Timed(self, stage)

    def add(self, stage: str, seconds: float) -> None:
        totals = self._own_totals()
        totals[stage] = totals.get(stage, 0.0) + seconds

    def _own_totals(self) -> dict[str, float]:
        try:
            return self._local.totals  # type: ignore[no-any-return]
        except AttributeError:
            totals: dict[str, float] = {}
            self._local.totals = totals
            with self._lock:
                self._totals.append(totals)
            return totals

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
            every = list(self._totals)
            threads = list(self._threads.items())
        out: dict[str, float] = {}
        for totals in every:
            # A copy is one step under the GIL: its thread may be adding meanwhile.
            for stage, seconds in totals.copy().items():
                out[stage] = out.get(stage, 0.0) + seconds
        for native_id, (role, thread) in threads:
            cpu = thread_cpu_seconds(native_id) if thread.is_alive() else None
            if cpu is None:
                with self._lock:
                    self._threads.pop(native_id, None)
            else:
                out[role] = out.get(role, 0.0) + cpu
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


class _Timed:
    """``CpuCosts.timed``'s context: a plain class, as cheap as the clock reads it makes
    (a ``contextmanager`` generator costs more than they do)."""

    __slots__ = ("_costs", "_stage", "_start")

    def __init__(self, costs: CpuCosts, stage: str) -> None:
        self._costs = costs
        self._stage = stage
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = self._costs._clock()

    def __exit__(self, *exc: object) -> None:
        costs = self._costs
        costs.add(self._stage, costs._clock() - self._start)
