"""Calibration of the coordinator's result check: honest products pass, cheats do not.

Part 1, honest tiles: every honest kernel (``tile_cases.honest_kernels``) on every value
distribution (``tile_cases.DISTRIBUTIONS``), at tile shapes from 1x16x1 to
4096x16384x4096, mm and bmm, fp32 and the half-precision tile dtypes. For each shape it
prints how many tiles were checked, how many were rejected (must be 0) and the largest
*margin* met: a statistic's size over its threshold, so 0.1 means honest rounding came to
a tenth of what the check allows (read with ``exact_margin``: the coordinator stops at a
bound where a tile passes without the norms of ``c``, the same verdict). The same per
kernel and per distribution.

Part 2, the detection floor: fp32 tiles of Gaussian operands, at every shape, each cheat
of ``tile_cases.CHEATS`` in every trial (caught / trials; a cheat that leaves the tile
bit-identical is not a trial), then the smallest uniform scale ``c * (1 + s)`` and the
smallest single-entry error (a fraction of max |c|) caught in every trial; then the same
cheats over every value distribution at one shape, and on bf16 tiles.

Check vectors come from a seeded generator here, so a run is reproducible; the
coordinator draws them from ``secrets``.

Run: ``python bench/calibrate_verify.py`` (about 10 minutes on 2 cores; ``--quick``
for a smoke run of a few seconds, ``--part honest|floor`` for one half).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.tile_cases import (  # noqa: E402
    CHEATS,
    DISTRIBUTIONS,
    ENTRY_FRACTIONS,
    SCALES,
    Shape,
    entry_cheat,
    honest_kernels,
    operands,
    product,
    scale_cheat,
    shapes_label,
)
from coordinator.tiles.check_parts import CheckPlan  # noqa: E402
from coordinator.tiles.honest_error import threshold  # noqa: E402
from coordinator.tiles.verify import check_product  # noqa: E402


@dataclass(frozen=True)
class ShapeRun:
    shape: Shape
    honest_repeats: int  # per kernel and distribution
    floor_trials: int
    kernels: tuple[str, ...] = ()  # all when empty
    distributions: tuple[str, ...] = ()


# Repeats fall as tiles grow, so that the whole run stays near ten minutes while small
# tiles, which are most numerous in a run and cheapest to check, pass 100,000 in all.
FP32_RUNS = (
    ShapeRun((None, 1, 16, 1), 400, 200),
    ShapeRun((None, 1, 1024, 1), 200, 100),
    ShapeRun((None, 16, 16, 16), 300, 100),
    ShapeRun((None, 7, 300, 5), 200, 100),
    ShapeRun((8, 16, 16, 16), 150, 100),
    ShapeRun((None, 64, 64, 64), 150, 60),
    ShapeRun((None, 1, 4096, 256), 20, 30),
    ShapeRun((None, 256, 1000, 10), 20, 30),
    ShapeRun((None, 256, 256, 256), 12, 30),
    ShapeRun((16, 256, 64, 256), 3, 20),
    ShapeRun((16, 256, 256, 64), 3, 20),
    ShapeRun((None, 128, 4096, 128), 4, 20),
    ShapeRun((None, 512, 512, 512), 3, 20),
    ShapeRun((None, 64, 16384, 64), 2, 10),
    ShapeRun((None, 1024, 1024, 1024), 1, 10),
    ShapeRun((4, 1024, 64, 1024), 1, 10),
    ShapeRun((None, 1024, 4096, 1024), 1, 5),
    ShapeRun((None, 256, 16384, 256), 1, 5),
    ShapeRun(
        (None, 2048, 2048, 2048),
        1,
        3,
        distributions=("gaussian", "post-ReLU", "non-negative", "row scales", "cancelling"),
    ),
    ShapeRun(
        (None, 4096, 16384, 4096),
        1,
        2,
        kernels=("torch, {threads} threads", "column-major operands", "numpy (its own BLAS)"),
        distributions=("gaussian", "non-negative", "cancelling"),
    ),
)
HALF_RUNS = (
    ShapeRun((None, 16, 16, 16), 60, 30),
    ShapeRun((None, 256, 256, 256), 4, 10),
    ShapeRun((16, 256, 64, 256), 2, 10),
    ShapeRun((None, 64, 4096, 64), 2, 10),
    ShapeRun((None, 1024, 1024, 1024), 1, 5),
)
QUICK_RUNS = (
    ShapeRun((None, 1, 16, 1), 4, 10),
    ShapeRun((None, 16, 16, 16), 2, 10),
    ShapeRun((2, 16, 64, 8), 2, 5),
    ShapeRun((None, 64, 256, 64), 1, 5),
)
# The floor over value distributions, at a shallow and a deep K (trials per shape).
FLOOR_DISTRIBUTION_RUNS = (
    ShapeRun((None, 256, 256, 256), 0, 20),
    ShapeRun((None, 128, 4096, 128), 0, 10),
)


@dataclass
class Worst:
    """Tiles checked, rejected, and the largest margin met, for one row of a table."""

    tiles: int = 0
    rejected: int = 0
    margin: float = 0.0
    where: str = ""

    def add(self, margin: float, ok: bool, where: str) -> None:
        self.tiles += 1
        self.rejected += not ok
        if margin > self.margin:
            self.margin, self.where = margin, where


@dataclass
class HonestReport:
    by_shape: dict[str, Worst] = field(default_factory=lambda: defaultdict(Worst))
    by_kernel: dict[str, Worst] = field(default_factory=lambda: defaultdict(Worst))
    by_distribution: dict[str, Worst] = field(default_factory=lambda: defaultdict(Worst))
    total: Worst = field(default_factory=Worst)


def _kernels_for(run: ShapeRun, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    threads = torch.get_num_threads()
    wanted = {name.format(threads=threads) for name in run.kernels}
    return [
        kernel
        for kernel in honest_kernels()
        if kernel.applies(run.shape, dtype) and (not wanted or kernel.name in wanted)
    ]


def honest_part(runs: tuple[ShapeRun, ...], dtype: torch.dtype, seed: int) -> HonestReport:
    report = HonestReport()
    checks = torch.Generator().manual_seed(seed)
    for run in runs:
        data = torch.Generator().manual_seed(
            seed + sum((d or 0) * 7**i for i, d in enumerate(run.shape))
        )
        label = f"{shapes_label(run.shape)} {str(dtype).removeprefix('torch.')}"
        kernels = _kernels_for(run, dtype)
        for distribution in run.distributions or tuple(DISTRIBUTIONS):
            for _ in range(run.honest_repeats):
                a, b = operands(distribution, run.shape, dtype, data)
                for kernel in kernels:
                    verdict = check_product(a, b, kernel.multiply(a, b), checks, exact_margin=True)
                    where = f"{label}, {kernel.name}, {distribution}"
                    for table, key in (
                        (report.by_shape, label),
                        (report.by_kernel, kernel.name),
                        (report.by_distribution, distribution),
                    ):
                        table[key].add(verdict.margin, verdict.ok, where)
                    report.total.add(verdict.margin, verdict.ok, where)
        print(f"  {label}: {report.by_shape[label].tiles} tiles", file=sys.stderr, flush=True)
    return report


def print_honest(report: HonestReport, title: str) -> None:
    print(f"\n{title}")
    for heading, table in (
        ("tile shape", report.by_shape),
        ("kernel", report.by_kernel),
        ("value distribution", report.by_distribution),
    ):
        print(f"{heading:>30} {'tiles':>8} {'rejected':>9} {'worst margin':>13}")
        for key, worst in table.items():
            print(f"{key:>30} {worst.tiles:>8} {worst.rejected:>9} {worst.margin:>13.4f}")
        print()
    total = report.total
    print(
        f"all: {total.tiles} honest tiles, {total.rejected} rejected, worst margin "
        f"{total.margin:.4f} ({total.where})"
    )


@dataclass
class FloorRow:
    caught: dict[str, tuple[int, int]] = field(default_factory=dict)
    weakest: dict[str, float] = field(default_factory=dict)  # smallest margin of a cheat
    smallest_scale: float | None = None
    smallest_entry: float | None = None


def _margin(a, b, bad, c, checks) -> float | None:  # type: ignore[no-untyped-def]
    """The check's margin on a cheat (above 1: caught), None if it changed nothing. The
    coordinator's own path: a caught cheat's margin is exact there too."""
    if torch.equal(bad, c):
        return None  # the cheat changed nothing here: not a trial
    return check_product(a, b, bad, checks).margin


def _caught(a, b, bad, c, checks) -> bool | None:  # type: ignore[no-untyped-def]
    margin = _margin(a, b, bad, c, checks)
    return None if margin is None else margin > 1.0


def floor_row(
    shape: Shape, dtype: torch.dtype, distribution: str, trials: int, seed: int
) -> FloorRow:
    data = torch.Generator().manual_seed(seed + 7)
    cheat_rng = torch.Generator().manual_seed(seed + 11)
    checks = torch.Generator().manual_seed(seed + 13)
    counts: dict[str, list[int]] = {name: [0, 0] for name in CHEATS}
    weakest: dict[str, float] = {}
    # Per size of error: [caught, trials]; a size that leaves every tile unchanged
    # (below the dtype's spacing) has no trials and counts for nothing.
    scale_counts = {s: [0, 0] for s in SCALES}
    entry_counts = {f: [0, 0] for f in ENTRY_FRACTIONS}
    previous = None
    for _ in range(trials):
        a, b = operands(distribution, shape, dtype, data)
        c = product(a, b)
        if previous is None:
            previous = product(*operands(distribution, shape, dtype, data))
        for name, cheat in CHEATS.items():
            margin = _margin(a, b, cheat(a, b, c, previous, cheat_rng), c, checks)
            if margin is not None:
                counts[name][0] += margin > 1.0
                counts[name][1] += 1
                weakest[name] = min(weakest.get(name, math.inf), margin)
        for sizes, make in ((scale_counts, scale_cheat), (entry_counts, entry_cheat)):
            for size, tally in sizes.items():
                verdict = _caught(a, b, make(size)(a, b, c, previous, cheat_rng), c, checks)
                if verdict is not None:
                    tally[0] += verdict
                    tally[1] += 1
        previous = c
    row = FloorRow({name: (got, of) for name, (got, of) in counts.items()}, weakest)
    row.smallest_scale = _smallest_always_caught(scale_counts)
    row.smallest_entry = _smallest_always_caught(entry_counts)
    return row


def _smallest_always_caught(counts: dict[float, list[int]]) -> float | None:
    """The smallest error size caught in every trial, with every larger size caught too."""
    smallest = None
    for size in sorted(counts, reverse=True):
        got, of = counts[size]
        if of == 0 or got < of:
            break
        smallest = size
    return smallest


def print_floor(rows: dict[str, FloorRow], title: str, key_heading: str) -> None:
    print(f"\n{title}")
    names = list(CHEATS)
    print(
        f"{key_heading:>24} "
        + " ".join(f"{_short(n):>9}" for n in names)
        + "  smallest scale / entry caught"
    )
    for key, row in rows.items():
        cells = []
        for name in names:
            got, of = row.caught[name]
            cells.append(f"{got}/{of}" if of else "n/a")
        scale = f"{row.smallest_scale:.0e}" if row.smallest_scale else "none"
        entry = f"{row.smallest_entry:.0e}" if row.smallest_entry else "none"
        print(f"{key:>24} " + " ".join(f"{cell:>9}" for cell in cells) + f"  {scale:>6} / {entry}")
    print("weakest margin of each cheat over its trials (statistic / threshold; caught above 1):")
    for key, row in rows.items():
        cells = [_compact(row.weakest[n]) if n in row.weakest else "n/a" for n in names]
        print(f"{key:>24} " + " ".join(f"{cell:>9}" for cell in cells))
    print("columns: " + "; ".join(f"{_short(n)} = {n}" for n in names))


def _compact(margin: float) -> str:
    return f"{margin:.2f}" if margin < 10 else f"{margin:.3g}" if margin < 1e4 else f"{margin:.0e}"


def _short(name: str) -> str:
    return {
        "fp16 operands": "fp16",
        "bf16 operands": "bf16",
        "TF32 operands": "TF32",
        "scale 1+1e-4": "x(1+1e-4)",
        "1 entry +-1e-3 max": "1 entry",
        "0.1% entries +-1e-3 max": "0.1%",
        "half of K": "half K",
        "replayed tile": "replay",
        "zeros": "zeros",
        "transposed operand": "transpose",
    }[name]


def print_plans(runs: tuple[ShapeRun, ...]) -> None:
    print(
        f"\n{'tile shape':>24} {'statistics':>10} {'chunks':>6} {'vectors':>7} "
        f"{'K blocks':>8} {'threshold':>9}"
    )
    for run in runs:
        batch, m, k, n = run.shape
        plan = CheckPlan.for_shape(batch or 1, m, k, n)
        print(
            f"{shapes_label(run.shape):>24} {plan.statistics:>10} {plan.chunks:>6} "
            f"{plan.vectors:>7} {plan.k_blocks:>8} {threshold(plan.statistics):>9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--part", choices=("honest", "floor", "both"), default="both")
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()
    started = time.monotonic()
    fp32_runs, half_runs = (QUICK_RUNS, QUICK_RUNS[:2]) if args.quick else (FP32_RUNS, HALF_RUNS)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, seed {args.seed}")
    print_plans(fp32_runs)
    if args.part in ("honest", "both"):
        report = honest_part(fp32_runs, torch.float32, args.seed)
        print_honest(
            report, "Honest fp32 tiles: rejected must be 0; margin = statistic / threshold"
        )
        halves = HonestReport()
        for dtype in (torch.bfloat16, torch.float16):
            part = honest_part(half_runs, dtype, args.seed)
            for name in ("by_shape", "by_kernel", "by_distribution"):
                for key, worst in getattr(part, name).items():
                    getattr(halves, name)[
                        f"{key}" if name == "by_shape" else f"{key} {str(dtype)[6:]}"
                    ] = worst
            halves.total.tiles += part.total.tiles
            halves.total.rejected += part.total.rejected
            if part.total.margin > halves.total.margin:
                halves.total.margin, halves.total.where = part.total.margin, part.total.where
        print_honest(halves, "Honest bf16 and fp16 tiles")
        print(
            f"\nhonest tiles in all: {report.total.tiles + halves.total.tiles}, rejected: "
            f"{report.total.rejected + halves.total.rejected}"
        )
    if args.part in ("floor", "both"):
        rows = {}
        for run in fp32_runs:
            rows[shapes_label(run.shape)] = floor_row(
                run.shape, torch.float32, "gaussian", run.floor_trials, args.seed
            )
            print(f"  floor {shapes_label(run.shape)}", file=sys.stderr, flush=True)
        print_floor(
            rows, "Detection floor, fp32 tiles, Gaussian operands (caught / trials)", "tile shape"
        )
        for run in QUICK_RUNS[-1:] if args.quick else FLOOR_DISTRIBUTION_RUNS:
            by_distribution = {
                name: floor_row(run.shape, torch.float32, name, run.floor_trials, args.seed)
                for name in DISTRIBUTIONS
            }
            print_floor(
                by_distribution,
                f"Detection floor over value distributions, fp32 {shapes_label(run.shape)}",
                "value distribution",
            )
        half_rows = {
            shapes_label(run.shape): floor_row(
                run.shape, torch.bfloat16, "gaussian", run.floor_trials, args.seed
            )
            for run in half_runs
        }
        print_floor(half_rows, "Detection floor, bf16 tiles, Gaussian operands", "tile shape")
    print(f"\n({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
