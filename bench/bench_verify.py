"""The coordinator's result check vs the tile's own GEMM, on the same shapes, in one process.

For each tile shape: time of ``check_product(a, b, c)`` (the check the coordinator runs on
every returned tile, threshold included) over time of ``torch.matmul(a, b)`` (what the
worker computed), both on the same thread count:

- *single*: one tile on its own, every operand summary computed for it;
- *in a grid*: the tiles of a 4 x 4 grid checked one after another with the server's
  ``CheckCache``, so each row block's and column block's summaries (row norms, ``b ρ``)
  are computed once and shared by the four tiles it is part of, as in a run;
- *batched*: the same 16 tiles in one ``check_products`` call, as the server checks the
  results that arrived together (tiles of one shape are stacked); time per tile.

The layout column says how the operand blocks lie: "rows" (row order), or "bT"/"aT" for a
block that lies transposed, as the coordinator sends and checks a linear layer's weight in
its forward (B) and its output gradient in its weight gradient (A).

Also: the check's arithmetic over the GEMM's (FLOP ratio), and result bytes checked per
second of one thread in a grid, to set against the coordinator's result ingress. DESIGN's
goals: at most 8% of the GEMM at 1024³ fp32 (grid) and 30% at 256³ with small tiles
checked in batches.

A second table checks tiles of a GPT's shapes whose operands and results are out of
the cache, as in a run: by the time a result comes back, the blocks were cut long
before and much else has passed through the cache. Each tile of a working set larger
than the last-level cache (``--cold-mb``) is checked once per round, against the same
tile checked again and again (in cache), one tile alone each.

A third table times the reference ``a (b ρ)`` as the check makes it, for a tile alone,
a row of tiles made together and a stack, with torch's products (the check where numba
is missing) and with numba's loops, alternated in this process.

Run: ``python bench/bench_verify.py [--threads N]``. Profile: ``python -m cProfile -s
tottime bench/bench_verify.py``; or torch.profiler around ``check_product``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from coordinator.tiles import row_products  # noqa: E402
from coordinator.tiles.check_parts import CheckCache, CheckPlan, new_generator  # noqa: E402
from coordinator.tiles.verify import _reference, check_product, check_products  # noqa: E402

SHAPES = [  # (batch or None, m, k, n, dtype, layout)
    (None, 256, 256, 256, torch.float32, "rows"),
    (None, 512, 512, 512, torch.float32, "rows"),
    (None, 1024, 1024, 1024, torch.float32, "rows"),
    (None, 2048, 2048, 2048, torch.float32, "rows"),
    (None, 1024, 4096, 1024, torch.float32, "rows"),
    (None, 1024, 1024, 1024, torch.bfloat16, "rows"),
    (16, 256, 64, 256, torch.float32, "rows"),  # attention-like bmm: small k
    (None, 1024, 1024, 1024, torch.float32, "bT"),  # a weight, in its forward
    (None, 1024, 1024, 1024, torch.float32, "aT"),  # an output gradient, in dW
]
GRID = 4
COLD_SHAPES = [  # (m, k, n, layout): tiles of a 12 x 768 GPT's GEMMs as a run cuts them
    (512, 768, 768, "rows"),
    (512, 768, 768, "bT"),  # a projection's forward
    (768, 1024, 768, "aT"),  # its weight gradient
    (1024, 1024, 768, "rows"),
]

REFERENCES = [  # (a's shape as the check holds it, b ρ's columns, K blocks, what it is)
    ((1, 512, 768), 4, 3, "a 512 x 768 x 768 tile alone"),
    ((1, 1024, 3072), 4, 12, "a 1024 x 3072 x 768 tile alone"),
    ((1, 1, 1024, 768), 24, 3, "a row of six 1024 x 768 x 768 tiles"),
    ((1, 2048, 2048), 16, 8, "a 2048³ tile alone (4 chunks)"),
    ((4, 1, 256, 256), 16, 1, "a 4 x 4 grid of 256³ in one stack"),
    ((96, 128, 64), 4, 1, "a 96 x 128 x 64 x 128 bmm tile"),
]


@contextlib.contextmanager
def torch_products() -> Iterator[None]:
    """The check as it runs where numba is missing: torch's products throughout."""
    kernels = row_products.kernels
    row_products.kernels = lambda: None
    try:
        yield
    finally:
        row_products.kernels = kernels


def reference_seconds(
    a_shape: tuple[int, ...], columns: int, k_blocks: int, repeat: int
) -> tuple[float, float]:
    """Seconds of one reference with torch's products and with numba's loops, the two
    alternated ``repeat`` times (best of each)."""
    a = torch.randn(*a_shape)
    projected = torch.randn(a_shape[-3], a_shape[-1], columns)
    plan = CheckPlan(a_shape[-2], 1, columns, columns, k_blocks)
    by_torch, by_loops = float("inf"), float("inf")
    for _ in range(repeat):
        with torch_products():
            by_torch = min(by_torch, _best_seconds(lambda: _reference(a, projected, plan), 3))
        by_loops = min(by_loops, _best_seconds(lambda: _reference(a, projected, plan), 3))
    return by_torch, by_loops


def _best_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def check_flops(batch: int, m: int, k: int, n: int) -> int:
    """c ρ, b ρ, a (b ρ) for each vector, and three sums of squares (row norms)."""
    plan = CheckPlan.for_shape(batch, m, k, n)
    per_vector = 2 * (m * n + k * n + m * k * plan.chunks)
    return batch * (plan.vectors * per_vector + 2 * (m * n + k * n + m * k))


def laid_out(t: torch.Tensor, operand: str, layout: str) -> torch.Tensor:
    """A copy of ``t`` in row order, or lying transposed where ``layout`` says so."""
    return t.mT.contiguous().mT if layout == f"{operand}T" else t.contiguous()


def grid_seconds(
    lead: tuple[int, ...], m: int, k: int, n: int, dtype: torch.dtype, layout: str, repeat: int
) -> tuple[float, float]:
    """Seconds per tile to check every tile of a GRID x GRID grid, sharing summaries: one
    tile after another, and all in one batch."""
    a = torch.randn(*lead, GRID * m, k).to(dtype)
    b = torch.randn(*lead, k, GRID * n).to(dtype)
    rows = [laid_out(a[..., i * m : (i + 1) * m, :], "a", layout) for i in range(GRID)]
    cols = [laid_out(b[..., j * n : (j + 1) * n], "b", layout) for j in range(GRID)]
    tiles = [(i, j, torch.matmul(rows[i], cols[j])) for i in range(GRID) for j in range(GRID)]
    gen = new_generator()

    def partners(j: int) -> Callable[[], list[tuple[int, torch.Tensor]]]:
        """The column blocks whose tiles with the same row block are still to be checked,
        as the server says them."""
        return lambda: [(later, cols[later]) for later in range(j + 1, GRID)]

    def check_all() -> None:
        cache = CheckCache()  # a fresh GEMM: nothing cached yet
        for i, j, c in tiles:
            verdict = check_product(
                rows[i], cols[j], c, gen, cache=cache, blocks=(i, j), partners=partners(j)
            )
            assert verdict.ok

    def check_batch() -> None:
        verdicts = check_products(
            [(rows[i], cols[j], c) for i, j, c in tiles],
            gen,
            cache=CheckCache(),
            blocks=[(i, j) for i, j, _ in tiles],
            partners=[partners(j) for _, j, _ in tiles],
        )
        assert all(v.ok for v in verdicts)

    count = len(tiles)
    return _best_seconds(check_all, repeat) / count, _best_seconds(check_batch, repeat) / count


def cold_seconds(
    m: int, k: int, n: int, layout: str, working_set: int, gen: torch.Generator, repeat: int
) -> tuple[float, float, float]:
    """Seconds of a tile's GEMM, and seconds per tile to check a tile alone: its operands
    and result in cache (the same tile again and again), and out of it (each of a
    working set of tiles of ``working_set`` bytes in turn)."""
    count = max(2, working_set // (4 * (m * k + k * n + m * n)))
    tiles = []
    for _ in range(count):
        a = laid_out(torch.randn(m, k), "a", layout)
        b = laid_out(torch.randn(k, n), "b", layout)
        tiles.append((a, b, torch.matmul(a, b)))
    a, b, c = tiles[0]
    gemm = _best_seconds(lambda: torch.matmul(a, b), repeat)
    hot = _best_seconds(lambda: check_product(a, b, c, gen), 10)

    def each_once() -> None:
        for a, b, c in tiles:
            assert check_product(a, b, c, gen).ok

    return gemm, hot, _best_seconds(each_once, 2) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--cold-mb", type=int, default=768, help="working set of the out-of-cache checks"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = new_generator()
    print(
        f"{'tile (batch x) m x k x n':>26} {'dtype':>9} {'layout':>6} {'gemm ms':>8} "
        f"{'single ms':>9} "
        f"{'ratio':>6} {'grid ms':>8} {'ratio':>6} {'batch ms':>8} {'ratio':>6} "
        f"{'flop ratio':>10} {'grid GB/s':>9}"
    )
    for batch, m, k, n, dtype, layout in SHAPES:
        lead = () if batch is None else (batch,)
        a = laid_out(torch.randn(*lead, m, k).to(dtype), "a", layout)
        b = laid_out(torch.randn(*lead, k, n).to(dtype), "b", layout)
        c = torch.matmul(a, b)
        assert check_product(a, b, c, gen).ok
        gemm_s = _best_seconds(lambda: torch.matmul(a, b), args.repeat)  # noqa: B023
        single_s = _best_seconds(lambda: check_product(a, b, c, gen), args.repeat)  # noqa: B023
        grid_s, batch_s = grid_seconds(lead, m, k, n, dtype, layout, args.repeat)
        flop_ratio = check_flops(batch or 1, m, k, n) / (2 * (batch or 1) * m * k * n)
        result_gb = c.numel() * c.element_size() / 1e9
        label = ("" if batch is None else f"{batch} x ") + f"{m} x {k} x {n}"
        print(
            f"{label:>26} {str(dtype).removeprefix('torch.'):>9} {layout:>6} {gemm_s * 1e3:>8.2f} "
            f"{single_s * 1e3:>9.2f} {single_s / gemm_s:>6.3f} {grid_s * 1e3:>8.2f} "
            f"{grid_s / gemm_s:>6.3f} {batch_s * 1e3:>8.2f} {batch_s / gemm_s:>6.3f} "
            f"{flop_ratio:>10.4f} {result_gb / grid_s:>9.2f}"
        )
    print(
        f"(best of {args.repeat}; {args.threads} torch thread(s); the check includes its "
        f"threshold; grid: {GRID}x{GRID} tiles sharing operand summaries; batch: the same "
        f"tiles in one check_products call)"
    )
    print()
    print(
        f"{'tile m x k x n':>22} {'layout':>6} {'gemm ms':>8} {'cached ms':>9} {'ratio':>6} "
        f"{'cold ms':>8} {'ratio':>6} {'cold/cached':>11}"
    )
    for m, k, n, layout in COLD_SHAPES:
        gemm_s, hot_s, cold_s = cold_seconds(m, k, n, layout, args.cold_mb << 20, gen, args.repeat)
        print(
            f"{f'{m} x {k} x {n}':>22} {layout:>6} {gemm_s * 1e3:>8.2f} {hot_s * 1e3:>9.2f} "
            f"{hot_s / gemm_s:>6.3f} {cold_s * 1e3:>8.2f} {cold_s / gemm_s:>6.3f} "
            f"{cold_s / hot_s:>11.2f}"
        )
    print(
        f"(one tile alone each; cached: the same tile checked again and again; cold: each "
        f"tile of {args.cold_mb} MB of tiles in turn, best of 2 rounds)"
    )
    if row_products.kernels() is None:
        return
    print()
    print(
        f"{'the reference a (b ρ) of':>36} {'columns':>7} {'K blocks':>8} {'torch µs':>9} "
        f"{'loops µs':>9} {'ratio':>6}"
    )
    for a_shape, columns, k_blocks, what in REFERENCES:
        by_torch, by_loops = reference_seconds(a_shape, columns, k_blocks, args.repeat)
        print(
            f"{what:>36} {columns:>7} {k_blocks:>8} {by_torch * 1e6:>9.1f} "
            f"{by_loops * 1e6:>9.1f} {by_loops / by_torch:>6.2f}"
        )
    print(
        "(torch's products, as where numba is missing, and numba's loops, alternated; "
        "ratio: loops over torch)"
    )


if __name__ == "__main__":
    main()
