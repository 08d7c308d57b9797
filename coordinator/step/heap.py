"""Giving the C heap's free memory back to the system once a training step is over.

A step allocates and frees its operand blocks, results, activations and gradients on
several threads (training, event loop, checks), and glibc keeps a heap per thread
(arena). A freed block goes back to the system only from the top of its arena: blocks
freed below ones still in use stay in the process as free memory, and step after step
the coordinator's RSS climbed above what any step holds at once. ``malloc_trim`` hands
the free pages of every arena back; between steps, when the step's tensors are gone,
is when most of the heap is free.

Elsewhere (macOS, Windows, musl) there is no ``malloc_trim`` and nothing is done.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim  # this process's libc
    except (OSError, AttributeError):
        return None
    return trim


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Return the heap's free pages to the system; False where the C library cannot.
    (ctypes lets go of the GIL for the call: the other threads run on meanwhile.)"""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
