"""The coordinator's C heap: kept for the next step's buffers, and given back to the
system once a training step is over if too much of it is free.

A step allocates and frees its operand blocks, results, activations and gradients on
several threads (training, event loop, checks), and glibc keeps a heap per thread
(arena). A freed block goes back to the system only from the top of its arena: blocks
freed below ones still in use stay in the process as free memory, and step after step
the coordinator's RSS climbed above what any step holds at once. ``malloc_trim`` hands
the free pages of every arena back; between steps, when the step's tensors are gone,
is when most of the heap is free.

Pages handed back are faulted in and zeroed again when the next step allocates, and a
step allocates again what the one before freed (its operand blocks, results and
activations): faulting them in anew costs the kernel about as much as the copies that
fill them. So the heap is trimmed only once its free memory passes both a bound
(``TRIM_ABOVE_BYTES``) and the memory the heap has in use, and then only if the heap
(free and in use) has grown by ``TRIM_GROWTH`` since it was last trimmed
(``StepTrims``): a step's transients are kept for the next one, while what
fragmentation adds over the steps goes back as the heap grows. The C library counts a
trimmed chunk as free still (its pages come back at the next write), so a model whose
step allocates more than it keeps between steps (a small model on a large batch) meets
the first condition at every step: without the growth condition every step would fault
in again all the memory the one before handed back.

Left to itself, glibc gives memory back sooner than that, at ``free``: a buffer above its
mmap threshold (at most 32 MiB) is a mapping of its own, the main heap is trimmed once
its free top passes a threshold, and a thread's heap is unmapped whole once free. A
thread's heap is at most 64 MiB, so a larger buffer made on a thread (the training's and
the checks' are) is a mapping of its own whatever the threshold. A step's frames, blocks,
outputs and a wide model's activations were fresh pages step after step, each faulted in
and unmapped again (an unmap every thread must flush from its TLB).
``keep_freed_memory``, at the process entry, puts every buffer of every thread in the
one main heap, which grows to any size, and turns the trim at ``free`` off, so only the
trim between steps gives memory back. The threads then share one lock to allocate
(Python's small objects have allocators of their own and do not take it). The heap
holds more than the mappings did: small allocations made between large buffers split
the free memory, so it grows until a step's buffers fit around them, and an outsized
buffer's memory stays until the trim that the heap's growth brings on.

Elsewhere (macOS, Windows, musl) there is no ``mallopt`` or ``malloc_trim`` and nothing
is done.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

TRIM_ABOVE_BYTES = 256 << 20  # free heap memory always kept rather than faulted in again
TRIM_GROWTH = 1.25  # growth of the heap since its last trim before it is trimmed again

# mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4
M_ARENA_MAX = -8

TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: never trim at free, in effect
TOP_PAD = 64 << 20  # what the heap grows by beyond a request: fewer, larger extensions


class _MallInfo2(ctypes.Structure):
    _fields_ = [  # noqa: RUF012 - ctypes' own declaration
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",  # bytes free in the arenas
            "keepcost",
        )
    ]


_Libc = tuple[
    Callable[[int], int] | None, Callable[[], _MallInfo2] | None, Callable[[int, int], int] | None
]


def _libc() -> _Libc:
    if not sys.platform.startswith("linux"):
        return None, None, None
    libc = ctypes.CDLL(None)  # this process's C library
    trim = getattr(libc, "malloc_trim", None)
    info = getattr(libc, "mallinfo2", None)  # glibc 2.33 on: without it, always trim
    if info is not None:
        info.restype = _MallInfo2
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is not None:
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        mallopt.restype = ctypes.c_int
    return trim, info, mallopt


_TRIM, _INFO, _MALLOPT = _libc()


def keep_freed_memory() -> bool:
    """Keep freed buffers in the process for the next ones (see the module); called
    once, at the coordinator's process entry, before the job's first buffers and
    threads, so the heap grows to fit them once. True where the C library took it."""
    if _MALLOPT is None:
        return False
    settings = (
        (M_ARENA_MAX, 1),
        (M_MMAP_MAX, 0),
        (M_TOP_PAD, TOP_PAD),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    )
    return all([_MALLOPT(parameter, value) for parameter, value in settings])


def heap_bytes() -> tuple[int, int] | None:
    """Bytes free and bytes in use in the C heap's arenas; None where the C library
    cannot say."""
    if _INFO is None:
        return None
    info = _INFO()
    return int(info.fordblks), int(info.uordblks)


def trim_due(
    free: int, in_use: int, above_bytes: int, up_to_in_use: bool, trimmed_at: int = 0
) -> bool:
    """Whether a heap with ``free`` and ``in_use`` bytes in its arenas is trimmed;
    ``trimmed_at``: its size (free and in use) when it was last trimmed."""
    if free <= above_bytes or (up_to_in_use and free <= in_use):
        return False
    return free + in_use > TRIM_GROWTH * trimmed_at


def release_free_memory(above_bytes: int = TRIM_ABOVE_BYTES, *, up_to_in_use: bool = True) -> bool:
    """Return the heap's free pages to the system if more than ``above_bytes`` are free
    and (with ``up_to_in_use``) more than the heap has in use, or if the C library cannot
    say; True when it trimmed. (ctypes lets go of the GIL for the call: the other
    threads run on meanwhile.)"""
    heap = heap_bytes()
    if heap is not None and not trim_due(*heap, above_bytes, up_to_in_use):
        return False
    return _trim()


def _trim() -> bool:
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class StepTrims:
    """``release_free_memory`` between training steps, once the heap has also grown by
    ``TRIM_GROWTH`` since its last trim (the module says why)."""

    def __init__(self, above_bytes: int = TRIM_ABOVE_BYTES) -> None:
        self.above_bytes = above_bytes
        self._trimmed_at = 0  # the heap's size (free and in use) at its last trim

    def after_step(self) -> bool:
        """Trim the heap if it is due; True when it was trimmed."""
        heap = heap_bytes()
        if heap is None:
            return release_free_memory(self.above_bytes)
        if not trim_due(*heap, self.above_bytes, True, self._trimmed_at):
            return False
        self._trimmed_at = sum(heap)
        return _trim()
