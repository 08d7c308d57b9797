"""The coordinator's Freivalds check vs the tile's own GEMM, on the same shapes, in one process.

For each tile shape: time of ``freivalds_ok(a, b, c)`` (the check the coordinator runs
on every returned tile, tolerance included) over time of ``torch.matmul(a, b)`` (what
the worker computed), both on the same thread count, plus the FLOP ratio of the check
(three matrix-vector products and their absolute-value twins for the tolerance) to
the GEMM's 2mkn. DESIGN's goal: the check costs <= 2% of the GEMM.
Run: ``python bench/bench_verify.py [--threads N]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from coordinator.verify import freivalds_ok, new_generator  # noqa: E402

SHAPES = [  # (batch or None, m, k, n, dtype)
    (None, 256, 256, 256, torch.float32),
    (None, 512, 512, 512, torch.float32),
    (None, 1024, 1024, 1024, torch.float32),
    (None, 2048, 2048, 2048, torch.float32),
    (None, 1024, 4096, 1024, torch.float32),
    (None, 1024, 1024, 1024, torch.bfloat16),
    (16, 256, 64, 256, torch.float32),  # attention-like bmm: small k
]


def _best_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def check_flops(m: int, k: int, n: int) -> int:
    # b r, a (b r), c r, and |b| |r|, |a| (|b||r|), |c| |r| for the tolerance
    return 2 * (2 * k * n + 2 * m * k + 2 * m * n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = new_generator()
    print(
        f"{'tile (batch x) m x k x n':>28} {'dtype':>9} {'gemm ms':>9} {'check ms':>9} "
        f"{'time ratio':>10} {'flop ratio':>10}"
    )
    for batch, m, k, n, dtype in SHAPES:
        lead = () if batch is None else (batch,)
        a = torch.randn(*lead, m, k).to(dtype)
        b = torch.randn(*lead, k, n).to(dtype)
        c = torch.matmul(a, b)
        assert freivalds_ok(a, b, c, gen)
        gemm_s = _best_seconds(lambda: torch.matmul(a, b), args.repeat)  # noqa: B023
        check_s = _best_seconds(lambda: freivalds_ok(a, b, c, gen), args.repeat)  # noqa: B023
        flop_ratio = check_flops(m, k, n) / (2 * m * k * n)
        label = ("" if batch is None else f"{batch} x ") + f"{m} x {k} x {n}"
        print(
            f"{label:>28} {str(dtype).removeprefix('torch.'):>9} {gemm_s * 1e3:>9.2f} "
            f"{check_s * 1e3:>9.2f} {check_s / gemm_s:>10.3f} {flop_ratio:>10.4f}"
        )
    print(f"(best of {args.repeat}; {args.threads} torch thread(s); check includes its tolerance)")


if __name__ == "__main__":
    main()
