"""Which GEMMs to offload, and how to cut each one into tiles.

Pure functions over shapes: no torch, no I/O. A GEMM `C[b, M, N] = A[b, M, K] @ B[b, K, N]`
is cut into a grid of (gb, gm, gn, gk) tiles. Every dimension is split as evenly as
possible, so the largest tile is the one at index (0, 0, 0, 0) and the smallest the last.

Order of preference when cutting, cheapest traffic first:
1. the batch dim of a bmm: its slices share no operands, so splitting costs nothing;
2. M and N, the larger side first: each cut re-sends one operand, so square-ish tiles
   keep the re-sent volume lowest;
3. K, only when a tile with full K cannot fit a worker's memory cap or the FLOP limit:
   every K part returns a whole partial output that the coordinator must add up.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from common.ops import TILE_OPS, TileOp

Grid = tuple[int, int, int, int]  # (gb, gm, gn, gk): parts per dim
_OPS = TILE_OPS


@dataclass(frozen=True)
class GemmShape:
    op: str  # a TileOp
    batch: int  # 1 for mm
    m: int
    n: int
    k: int
    itemsize: int  # bytes per element on the wire (4 fp32, 2 bf16/fp16)

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"unknown GEMM op {self.op!r}; expected one of {_OPS}")
        if self.op == TileOp.MM and self.batch != 1:
            raise ValueError(f"mm has batch 1, got {self.batch}")
        if min(self.dims) < 0:
            raise ValueError(f"GEMM dims must be >= 0, got {self.dims}")
        if self.itemsize < 1:
            raise ValueError(f"itemsize must be >= 1, got {self.itemsize}")

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return (self.batch, self.m, self.n, self.k)

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k

    @property
    def operand_bytes(self) -> int:
        return self.itemsize * self.batch * (self.m * self.k + self.k * self.n)

    @property
    def output_bytes(self) -> int:
        return self.itemsize * self.batch * self.m * self.n


@dataclass(frozen=True)
class TileRegion:
    index: tuple[int, int, int, int]  # (bi, mi, ni, ki) position in the grid
    # Half-open ranges into the GEMM's batch, M, N and K dims.
    b0: int
    b1: int
    m0: int
    m1: int
    n0: int
    n1: int
    k0: int
    k1: int

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return (self.b1 - self.b0, self.m1 - self.m0, self.n1 - self.n0, self.k1 - self.k0)

    @property
    def flops(self) -> int:
        b, m, n, k = self.dims
        return 2 * b * m * n * k

    @property
    def out_key(self) -> tuple[int, int, int]:
        # Tiles that differ only in ki are K-partials of one output block.
        bi, mi, ni, _ = self.index
        return (bi, mi, ni)

    def down_bytes(self, itemsize: int) -> int:
        b, m, n, k = self.dims
        return itemsize * b * (m * k + k * n)

    def up_bytes(self, itemsize: int) -> int:
        b, m, n, _ = self.dims
        return itemsize * b * m * n

    def total_bytes(self, itemsize: int) -> int:
        """Operands plus output: what must fit in a worker's memory cap."""
        return self.down_bytes(itemsize) + self.up_bytes(itemsize)


@dataclass(frozen=True)
class PlanConfig:
    min_offload_flops: int = 1 << 20  # GEMMs smaller than this run at the coordinator
    max_tile_flops: int = 1 << 31  # upper bound on one tile's work
    tile_mem_cap_bytes: int = 256 << 20  # a tile's operands+output must fit a worker's cap
    target_tiles: int = 4  # aim for at least this many tiles (usually ~2x connected workers)
    min_tile_flops: int = 1 << 20  # never cut tiles smaller than this just to reach target_tiles
    # When the limits force cuts, M/N sides are not cut below this (unless the dim is
    # smaller); K is split instead. A tile with sides s and full K moves ~1/s bytes per
    # FLOP, a near-cubic K-split tile of the default FLOP limit ~1/680: below ~256 the
    # re-sent operands cost more than the partial sums K splitting adds.
    min_tile_side: int = 256
    # A tile's result check needs enough output entries: in a tile of one or a few, an
    # entry that happens to be near zero (its terms cancel) has rounding larger than
    # any error relative to it, so a wrong value can pass. GEMMs whose tiles would be
    # smaller stay at the coordinator (coordinator.tiles.verify; bench/calibrate_verify.py).
    min_tile_outputs: int = 16

    def __post_init__(self) -> None:
        for name in (
            "min_offload_flops",
            "max_tile_flops",
            "tile_mem_cap_bytes",
            "target_tiles",
            "min_tile_flops",
            "min_tile_side",
            "min_tile_outputs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"PlanConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class GemmPlan:
    shape: GemmShape
    grid: Grid  # (gb, gm, gn, gk)
    tiles: tuple[TileRegion, ...]  # in row-major order of index

    @property
    def k_split(self) -> bool:
        return self.grid[3] > 1


def even_split(size: int, parts: int) -> list[tuple[int, int]]:
    """Cut range(size) into `parts` contiguous half-open ranges whose lengths differ by <= 1.

    The longer ranges come first, so range 0 is always a largest one.
    """
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if parts < 1 or parts > max(size, 1):
        raise ValueError(f"cannot split {size} into {parts} non-empty parts")
    base, extra = divmod(size, parts)
    ranges = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


# A step plans the same shapes under the same limits every time, and the cost model
# tries several grids of each: a plan is made once (shape, config and plan are frozen).
@functools.lru_cache(maxsize=4096)
def plan_gemm(shape: GemmShape, config: PlanConfig = PlanConfig()) -> GemmPlan | None:
    """Tile grid for one GEMM, or None when it is cheaper to run it at the coordinator.

    Raises ValueError when not even a 1x1x1 tile fits the memory cap or FLOP limit.
    """
    if min(shape.dims) == 0 or shape.flops < config.min_offload_flops:
        return None
    _check_feasible(shape, config)
    grid = _grid_for_limits(shape, config)
    if _smallest_tile_outputs(shape, grid) < config.min_tile_outputs:
        return None  # too few outputs per tile to check: computed here
    grid = _grow_to_target(shape, config, grid)
    return GemmPlan(shape=shape, grid=grid, tiles=_tiles(shape, grid))


@functools.lru_cache(maxsize=4096)
def grid_plan(shape: GemmShape, grid: Grid, config: PlanConfig = PlanConfig()) -> GemmPlan | None:
    """The plan on exactly `grid`, or None where plan_gemm would keep the GEMM here, the
    grid cuts a dim into more parts than it has, or its tiles break `config`'s memory cap
    or FLOP limit or have too few outputs to check."""
    if min(shape.dims) == 0 or shape.flops < config.min_offload_flops:
        return None
    if any(not 1 <= parts <= size for size, parts in zip(shape.dims, grid, strict=True)):
        return None
    if not _fits(shape, config, grid):
        return None
    if _smallest_tile_outputs(shape, grid) < config.min_tile_outputs:
        return None
    return GemmPlan(shape=shape, grid=grid, tiles=_tiles(shape, grid))


def _check_feasible(shape: GemmShape, config: PlanConfig) -> None:
    if not _fits(shape, config, shape.dims):
        raise ValueError(
            f"cannot tile {shape}: even a single-element tile needs {3 * shape.itemsize} "
            f"bytes and 2 FLOPs, but the limits are tile_mem_cap_bytes="
            f"{config.tile_mem_cap_bytes} and max_tile_flops={config.max_tile_flops}"
        )


def _largest_tile(shape: GemmShape, grid: Grid) -> tuple[int, int, int, int]:
    b, m, n, k = (-(-size // parts) for size, parts in zip(shape.dims, grid, strict=True))
    return (b, m, n, k)


def _fits(shape: GemmShape, config: PlanConfig, grid: Grid) -> bool:
    """Does the grid's largest tile respect the memory cap and the FLOP limit?"""
    b, m, n, k = _largest_tile(shape, grid)
    tile_bytes = shape.itemsize * b * (m * k + k * n + m * n)
    return tile_bytes <= config.tile_mem_cap_bytes and 2 * b * m * n * k <= config.max_tile_flops


def _smallest_tile(shape: GemmShape, grid: Grid) -> tuple[int, int, int, int]:
    b, m, n, k = (size // parts for size, parts in zip(shape.dims, grid, strict=True))
    return (b, m, n, k)


def _smallest_tile_flops(shape: GemmShape, grid: Grid) -> int:
    b, m, n, k = _smallest_tile(shape, grid)
    return 2 * b * m * n * k


def _smallest_tile_outputs(shape: GemmShape, grid: Grid) -> int:
    b, m, n, _ = _smallest_tile(shape, grid)
    return b * m * n


def _tile_count(grid: Grid) -> int:
    gb, gm, gn, gk = grid
    return gb * gm * gn * gk


def _grid_for_limits(shape: GemmShape, config: PlanConfig) -> Grid:
    """The coarsest grid, in order of preference, whose tiles all respect the limits."""
    batch, m, n, _ = shape.dims
    gb = _smallest_parts(batch, lambda g: _fits(shape, config, (g, 1, 1, 1)))
    if _fits(shape, config, (gb, 1, 1, 1)):
        return (gb, 1, 1, 1)
    finest_m = max(1, m // config.min_tile_side)
    finest_n = max(1, n // config.min_tile_side)
    if _fits(shape, config, (batch, finest_m, finest_n, 1)):
        return _split_mn_until_fit(shape, config, finest_m, finest_n)
    return _split_mnk_until_fit(shape, config)


def _smallest_parts(size: int, ok: Callable[[int], bool]) -> int:
    """Fewest parts in 1..size for which ok(parts) holds, or size if none; ok is monotone."""
    lo, hi = 1, size
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _split_mn_until_fit(shape: GemmShape, config: PlanConfig, max_gm: int, max_gn: int) -> Grid:
    # Terminates: the caller checked that (max_gm, max_gn), where the walk ends, fits.
    grid: Grid = (shape.batch, 1, 1, 1)
    while not _fits(shape, config, grid):
        step = _next_mn_split(shape, grid, max_gm, max_gn)
        if step is None:
            raise AssertionError(f"M/N walk ended without fitting: {shape} {grid}")
        grid = step
    return grid


def _split_mnk_until_fit(shape: GemmShape, config: PlanConfig) -> Grid:
    # Cutting the longest side keeps tiles near-cubic, which moves the fewest bytes per
    # FLOP; the walk ends at 1x1x1 tiles, which _check_feasible showed fit.
    batch = shape.batch
    grid: Grid = (batch, 1, 1, 1)
    while not _fits(shape, config, grid):
        parts = list(grid[1:])
        sides = _largest_tile(shape, grid)[1:]
        sizes = shape.dims[1:]
        splittable = [d for d in range(3) if parts[d] < sizes[d]]
        # Longest side first; ties go to M, then N, then K.
        dim = max(splittable, key=lambda d: (sides[d], -d))
        parts[dim] += 1
        grid = (batch, parts[0], parts[1], parts[2])
    return grid


def _next_mn_split(shape: GemmShape, grid: Grid, max_gm: int, max_gn: int) -> Grid | None:
    """One more cut along the longer of the tile's M/N sides (M on a tie), if allowed."""
    gb, gm, gn, gk = grid
    _, cm, cn, _ = _largest_tile(shape, grid)
    split_m = (gm + 1, gn)
    split_n = (gm, gn + 1)
    order = (split_m, split_n) if cm >= cn else (split_n, split_m)
    for new_gm, new_gn in order:
        if new_gm <= max_gm and new_gn <= max_gn:
            return (gb, new_gm, new_gn, gk)
    return None


def _grow_to_target(shape: GemmShape, config: PlanConfig, grid: Grid) -> Grid:
    """Cut further until target_tiles is reached, as long as tiles keep min_tile_flops
    and min_tile_outputs.

    Never splits K: more tiles are for more workers, and K parts cost extra output traffic.
    """
    while _tile_count(grid) < config.target_tiles:
        step = _next_target_split(shape, grid)
        if (
            step is None
            or _smallest_tile_flops(shape, step) < config.min_tile_flops
            or _smallest_tile_outputs(shape, step) < config.min_tile_outputs
        ):
            break
        grid = step
    return grid


def _next_target_split(shape: GemmShape, grid: Grid) -> Grid | None:
    gb, gm, gn, gk = grid
    if gb < shape.batch:
        return (gb + 1, gm, gn, gk)
    return _next_mn_split(shape, grid, shape.m, shape.n)


def align_plan(plan: GemmPlan, units: tuple[int, int, int, int]) -> GemmPlan:
    """The plan with every tile boundary on a multiple of ``units`` per dim (b, m, n, k).

    A convolution's patch operand can only be cut between images (rows) and between
    channels (columns): a tile then carries whole image blocks, which the worker unfolds.
    A dim cut into more parts than it has units is cut into one part per unit."""
    if units == (1, 1, 1, 1):
        return plan
    for size, unit in zip(plan.shape.dims, units, strict=True):
        if unit < 1 or size % unit:
            raise ValueError(f"dims {plan.shape.dims} are not multiples of units {units}")
    grid: Grid = tuple(  # type: ignore[assignment]
        max(1, min(parts, size // unit))
        for size, parts, unit in zip(plan.shape.dims, plan.grid, units, strict=True)
    )
    return GemmPlan(plan.shape, grid, _tiles(plan.shape, grid, units))


def _tiles(
    shape: GemmShape, grid: Grid, units: tuple[int, int, int, int] = (1, 1, 1, 1)
) -> tuple[TileRegion, ...]:
    splits = [
        list(
            enumerate(
                [(lo * unit, hi * unit) for lo, hi in even_split(size // unit, parts)]
                if size
                else even_split(size, parts)
            )
        )
        for size, parts, unit in zip(shape.dims, grid, units, strict=True)
    ]
    return tuple(
        TileRegion((bi, mi, ni, ki), b0, b1, m0, m1, n0, n1, k0, k1)
        for (bi, (b0, b1)), (mi, (m0, m1)), (ni, (n0, n1)), (ki, (k0, k1)) in itertools.product(
            *splits
        )
    )


def plan_config_for(min_offload_mflop: float) -> Callable[[int, int | None], PlanConfig]:
    """The planner's limits for a pool of ``workers`` with the smallest ``memory_cap``."""

    def config(workers: int, memory_cap: int | None) -> PlanConfig:
        return PlanConfig(
            min_offload_flops=int(min_offload_mflop * 1e6),
            target_tiles=max(2, 2 * workers),
            # Never above the default: it keeps every tile well inside the wire limits.
            tile_mem_cap_bytes=min(
                memory_cap or PlanConfig.tile_mem_cap_bytes, PlanConfig.tile_mem_cap_bytes
            ),
        )

    return config
