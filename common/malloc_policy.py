"""How the coordinator's process sets up the C allocator (glibc's ``malloc``).

A training step moves gigabytes through buffers of a few megabytes each: frames
received, operand blocks laid out for the wire, GEMM outputs assembled from tiles.
glibc's defaults hand such buffers back to the kernel soon after they are freed (one
above the mmap threshold is its own mapping, unmapped at ``free``; the top of the heap
is trimmed once enough of it is free), so the next step's buffer of the same size is
fresh memory again: a page fault for every 4 KiB it writes, and an unmap that every
thread of the process must flush from its TLB. In the coordinator that was a large
share of its system time. Kept in the process, freed memory serves the next buffer
without either, and the peak moves little: what a step frees is what the next step
allocates again.

Buffers above the mmap threshold (at most 32 MiB: glibc refuses more) still get
mappings of their own, so one outsized tensor does not pin its memory for good.

Elsewhere (macOS, Windows, musl) nothing is changed: their allocators have no such
switches, or none that this reaches.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts (half its heap's maximum size)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: never trim, in effect
# What a heap keeps free beyond its requests. With glibc's 128 KiB the two settings
# above left a served step's page faults about where they were: threads other than the
# main one (training, checks) allocate in heaps of their own, which glibc unmaps whole
# once free unless that would leave less than this pad spare (no trim threshold there).
TOP_PAD = 64 << 20


def keep_freed_memory() -> bool:
    """Keep freed buffers up to ``MMAP_THRESHOLD`` in the process for reuse (see the
    module). True where the allocator took them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    taken = [
        mallopt(parameter, value)
        for parameter, value in (
            (M_TOP_PAD, TOP_PAD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        )
    ]
    return all(taken)
