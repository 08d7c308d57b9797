"""How fast this machine multiplies fp32 matrices: the figure cost models plan with.

Shared by the worker (its hello profile) and the coordinator (its own share of tiles),
so both sides of a plan are measured the same way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def matmul_gflops(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    synchronize: Callable[[], None] = lambda: None,
    target_s: float = 0.02,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """GFLOP/s of ``a @ b``, timed for about ``target_s`` after two warm-up runs.

    The median run counts: start-up stays fast, one-off costs (thread pool start,
    first-touch allocation) and a stray preemption do not skew the figure.
    """
    m, k = a.shape
    n = b.shape[1]
    for _ in range(2):
        torch.matmul(a, b)
    synchronize()
    run_times: list[float] = []
    start = clock()
    while True:
        before = clock()
        torch.matmul(a, b)
        synchronize()  # GPU kernels are asynchronous: time them finished
        after = clock()
        run_times.append(after - before)
        if after - start >= target_s:
            break
    return 2.0 * m * n * k / max(statistics.median(run_times), 1e-9) / 1e9
