"""How many torch threads the coordinator's own threads multiply with.

Orchestrating a step (cutting blocks, the non-GEMM ops, the optimizer, the checks) runs
on one torch thread per coordinator thread: OpenMP's setting is per calling thread, and
a team of helpers on these small, memory-bound ops mostly spins, taking cores from the
event loop and adding their CPU to the coordinator's. Where the coordinator multiplies
tiles itself (its planned share, stranded tiles) it is computing, not orchestrating, and
torch's full team is worth its cost.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Torch's default for this machine, read before any thread is set to one.
COMPUTE_THREADS = torch.get_num_threads()


def orchestrate_on_one_thread() -> None:
    """The calling thread's torch ops run single-threaded from now on."""
    torch.set_num_threads(1)


@contextmanager
def computing() -> Iterator[None]:
    """Torch's full team for the calling thread while it multiplies tiles itself."""
    with _threads(COMPUTE_THREADS):
        yield


@contextmanager
def orchestrating() -> Iterator[None]:
    """One torch thread for the calling thread for a while: for orchestration on a
    thread the coordinator does not own (an event loop that may be its host's main
    thread), whose setting is left as it was."""
    with _threads(1):
        yield


@contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
