"""Planner: which GEMMs to offload and how each is tiled.

Exact tables for hand-checked shapes, then hypothesis properties over random shapes and
limits: tiles partition the GEMM's box, respect the limits, and are cut in the documented
order of preference (batch, then M/N, then K only when forced).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.plan.planner import (
    GemmPlan,
    GemmShape,
    PlanConfig,
    TileRegion,
    even_split,
    plan_gemm,
)

FP32 = 4
BF16 = 2
DEFAULT = PlanConfig()


def mm(m: int, n: int, k: int, itemsize: int = FP32) -> GemmShape:
    return GemmShape(op="mm", batch=1, m=m, n=n, k=k, itemsize=itemsize)


def bmm(batch: int, m: int, n: int, k: int, itemsize: int = FP32) -> GemmShape:
    return GemmShape(op="bmm", batch=batch, m=m, n=n, k=k, itemsize=itemsize)


# --- even_split -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "parts", "expected"),
    [
        (0, 1, [(0, 0)]),
        (1, 1, [(0, 1)]),
        (10, 1, [(0, 10)]),
        (10, 2, [(0, 5), (5, 10)]),
        (10, 3, [(0, 4), (4, 7), (7, 10)]),
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
        (5, 5, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
        (7, 2, [(0, 4), (4, 7)]),
    ],
)
def test_even_split_table(size: int, parts: int, expected: list[tuple[int, int]]) -> None:
    assert even_split(size, parts) == expected


@pytest.mark.parametrize(("size", "parts"), [(5, 0), (5, 6), (0, 2), (-1, 1), (3, -1)])
def test_even_split_rejects_impossible_splits(size: int, parts: int) -> None:
    with pytest.raises(ValueError):
        even_split(size, parts)


@given(size=st.integers(1, 10_000), parts=st.integers(1, 200))
def test_even_split_is_contiguous_and_balanced(size: int, parts: int) -> None:
    parts = min(parts, size)
    ranges = even_split(size, parts)
    assert len(ranges) == parts
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    lengths = [stop - start for start, stop in ranges]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the first tile is a largest one


# --- exact plans ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "config", "grid"),
    [
        # Big enough to offload; target 4 reached with square-ish tiles.
        (mm(128, 128, 128), DEFAULT, (1, 2, 2, 1)),
        # A 2x2 grid would make 0.5 MFLOP tiles, below min_tile_flops: stop at 2.
        (mm(128, 128, 64), DEFAULT, (1, 2, 1, 1)),
        (mm(512, 512, 512, BF16), PlanConfig(target_tiles=3), (1, 2, 2, 1)),
        (mm(1024, 1024, 1024), PlanConfig(target_tiles=16), (1, 4, 4, 1)),
        # Tall-skinny: only the long side is cut.
        (mm(8192, 64, 64), DEFAULT, (1, 4, 1, 1)),
        # Uneven sides: cut the longer one until they are about equal.
        (mm(100, 300, 200), PlanConfig(target_tiles=6), (1, 2, 3, 1)),
        # max_tile_flops (2^31 = one 1024^3 GEMM) forces 512x512 tiles of a 4096^3 GEMM.
        (mm(4096, 4096, 4096), DEFAULT, (1, 8, 8, 1)),
        # The whole GEMM (12 MiB) exceeds an 8 MiB cap; halving M already fits (8 MiB).
        (
            mm(1024, 1024, 1024),
            PlanConfig(tile_mem_cap_bytes=8 << 20, target_tiles=1),
            (1, 2, 1, 1),
        ),
        (mm(1024, 1024, 1024), PlanConfig(tile_mem_cap_bytes=8 << 20), (1, 2, 2, 1)),
        # bmm: batch first, and only then M/N.
        (bmm(8, 128, 128, 64), DEFAULT, (4, 1, 1, 1)),
        (bmm(64, 512, 512, 64, BF16), PlanConfig(target_tiles=8), (8, 1, 1, 1)),
        (bmm(2, 256, 256, 256), DEFAULT, (2, 2, 1, 1)),
        (bmm(3, 64, 64, 64), PlanConfig(target_tiles=5, min_tile_flops=1 << 16), (3, 2, 1, 1)),
        (bmm(4, 2048, 2048, 2048), DEFAULT, (4, 3, 3, 1)),
        # K split: M and N are already at 64 (below min_tile_side), the full-K tile is
        # 512 MiB and 8.6 GFLOP; four K parts bring it to 128 MiB and 2^31 FLOPs.
        (mm(64, 64, 1 << 20), DEFAULT, (1, 1, 1, 4)),
        # Even 256x256 tiles with full K exceed the FLOP limit: near-cubic 1024^3 tiles.
        (mm(4096, 4096, 1 << 16), DEFAULT, (1, 4, 4, 64)),
        # A 1 MiB cap cannot hold a 256x256 tile with full K (2.3 MiB): K is cut as well.
        (mm(1024, 1024, 1024), PlanConfig(tile_mem_cap_bytes=1 << 20), (1, 4, 4, 3)),
        # M = N = 300 is a single part at min_tile_side 256, and a 300x300 full-K tile
        # (229 MiB) exceeds 128 MiB: K is split rather than cutting 150-wide tiles.
        (
            mm(300, 300, 100_000),
            PlanConfig(tile_mem_cap_bytes=128 << 20, max_tile_flops=1 << 40),
            (1, 2, 1, 2),
        ),
        # A cap of 3 fp32 values leaves single-element tiles only.
        (
            mm(8, 8, 8),
            PlanConfig(
                min_offload_flops=1, tile_mem_cap_bytes=12, min_tile_flops=1, min_tile_outputs=1
            ),
            (1, 8, 8, 8),
        ),
    ],
)
def test_plan_table(shape: GemmShape, config: PlanConfig, grid: tuple[int, ...]) -> None:
    plan = plan_gemm(shape, config)
    assert plan is not None
    assert plan.grid == grid
    assert plan.k_split == (grid[3] > 1)
    assert_partition(plan)
    assert_within_limits(plan, config)


def test_tile_geometry_and_bytes() -> None:
    plan = plan_gemm(bmm(2, 256, 256, 256), DEFAULT)
    assert plan is not None
    first = plan.tiles[0]
    assert first == TileRegion(
        index=(0, 0, 0, 0), b0=0, b1=1, m0=0, m1=128, n0=0, n1=256, k0=0, k1=256
    )
    assert first.dims == (1, 128, 256, 256)
    assert first.flops == 2 * 128 * 256 * 256
    assert first.down_bytes(FP32) == FP32 * (128 * 256 + 256 * 256)
    assert first.up_bytes(FP32) == FP32 * 128 * 256
    assert first.total_bytes(FP32) == first.down_bytes(FP32) + first.up_bytes(FP32)
    assert first.out_key == (0, 0, 0)
    assert [t.index for t in plan.tiles] == [(0, 0, 0, 0), (0, 1, 0, 0), (1, 0, 0, 0), (1, 1, 0, 0)]


def test_k_partials_share_an_out_key() -> None:
    plan = plan_gemm(mm(64, 64, 1 << 20), DEFAULT)
    assert plan is not None and plan.k_split
    assert {t.out_key for t in plan.tiles} == {(0, 0, 0)}
    assert [t.index[3] for t in plan.tiles] == [0, 1, 2, 3]


def test_shape_properties() -> None:
    shape = bmm(3, 4, 5, 6, BF16)
    assert shape.flops == 2 * 3 * 4 * 5 * 6
    assert shape.operand_bytes == BF16 * 3 * (4 * 6 + 6 * 5)
    assert shape.output_bytes == BF16 * 3 * 4 * 5


# --- local decisions and errors ---------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        mm(64, 64, 64),  # 0.5 MFLOP < 1 MFLOP
        mm(0, 4096, 4096),
        mm(4096, 0, 4096),
        mm(4096, 4096, 0),
        bmm(0, 512, 512, 512),
    ],
)
def test_small_or_empty_gemms_run_locally(shape: GemmShape) -> None:
    assert plan_gemm(shape, DEFAULT) is None


@pytest.mark.parametrize(
    ("shape", "grid"),
    [
        (mm(1, 1, 1 << 20), None),  # 2 MFLOP, one output entry: too few to check
        (mm(3, 5, 1 << 17), None),  # 15 outputs
        (mm(4, 4, 1 << 16), (1, 1, 1, 1)),  # 16 outputs: one tile, not cut further
        # Four outputs per batch entry: tiles keep four entries each (16 outputs).
        (bmm(64, 2, 2, 1 << 16), (16, 1, 1, 1)),
    ],
)
def test_tiles_keep_enough_outputs_to_be_checked(
    shape: GemmShape, grid: tuple[int, ...] | None
) -> None:
    plan = plan_gemm(shape, PlanConfig(target_tiles=64))
    assert (plan.grid if plan else None) == grid


def test_threshold_is_inclusive() -> None:
    exactly = mm(64, 64, 128)  # 2 * 64 * 64 * 128 = 2^20
    assert plan_gemm(exactly, DEFAULT) is not None
    assert plan_gemm(exactly, PlanConfig(min_offload_flops=(1 << 20) + 1)) is None


@pytest.mark.parametrize(
    "config",
    [
        PlanConfig(tile_mem_cap_bytes=11),  # one fp32 element each of A, B, C is 12 bytes
        PlanConfig(max_tile_flops=1),
    ],
)
def test_impossible_limits_raise(config: PlanConfig) -> None:
    with pytest.raises(ValueError, match="cannot tile"):
        plan_gemm(mm(256, 256, 256), config)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"op": "conv", "batch": 1, "m": 1, "n": 1, "k": 1, "itemsize": 4},
        {"op": "mm", "batch": 2, "m": 1, "n": 1, "k": 1, "itemsize": 4},
        {"op": "bmm", "batch": 2, "m": -1, "n": 1, "k": 1, "itemsize": 4},
        {"op": "mm", "batch": 1, "m": 1, "n": 1, "k": 1, "itemsize": 0},
    ],
)
def test_bad_shapes_raise(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GemmShape(**kwargs)  # type: ignore[arg-type]


def test_bad_config_raises() -> None:
    with pytest.raises(ValueError, match="target_tiles"):
        PlanConfig(target_tiles=0)


# --- properties -------------------------------------------------------------------------


def assert_partition(plan: GemmPlan) -> None:
    """Tiles are the product of one even split per dim, in row-major order: a partition."""
    shape = plan.shape
    per_dim: list[list[tuple[int, int]]] = [[], [], [], []]
    for tile in plan.tiles:
        bounds = [(tile.b0, tile.b1), (tile.m0, tile.m1), (tile.n0, tile.n1), (tile.k0, tile.k1)]
        for dim, (index, bound) in enumerate(zip(tile.index, bounds, strict=True)):
            assert bound == even_split(shape.dims[dim], plan.grid[dim])[index]
            if bound not in per_dim[dim]:
                per_dim[dim].append(bound)
    indices = [t.index for t in plan.tiles]
    assert indices == sorted(indices) and len(set(indices)) == len(indices)
    assert len(plan.tiles) == plan.grid[0] * plan.grid[1] * plan.grid[2] * plan.grid[3]
    for dim, bounds in enumerate(per_dim):
        assert len(bounds) == plan.grid[dim] <= max(shape.dims[dim], 1)
    volume = sum(t.dims[0] * t.dims[1] * t.dims[2] * t.dims[3] for t in plan.tiles)
    assert volume == shape.batch * shape.m * shape.n * shape.k
    assert sum(t.flops for t in plan.tiles) == shape.flops


def assert_within_limits(plan: GemmPlan, config: PlanConfig) -> None:
    for tile in plan.tiles:
        assert tile.total_bytes(plan.shape.itemsize) <= config.tile_mem_cap_bytes
        assert tile.flops <= config.max_tile_flops


def fits(shape: GemmShape, config: PlanConfig, tile: tuple[int, int, int, int]) -> bool:
    b, m, n, k = tile
    tile_bytes = shape.itemsize * b * (m * k + k * n + m * n)
    return tile_bytes <= config.tile_mem_cap_bytes and 2 * b * m * n * k <= config.max_tile_flops


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def shapes_and_configs(draw: st.DrawFn) -> tuple[GemmShape, PlanConfig]:
    op = draw(st.sampled_from(["mm", "bmm"]))
    batch = 1 if op == "mm" else draw(st.integers(1, 6))
    m, n, k = (draw(st.integers(1, 48)) for _ in range(3))
    itemsize = draw(st.sampled_from([2, 4]))
    shape = GemmShape(op=op, batch=batch, m=m, n=n, k=k, itemsize=itemsize)
    whole_bytes = shape.operand_bytes + shape.output_bytes
    # Limits drawn relative to the GEMM keep the tile count small enough to check.
    config = PlanConfig(
        min_offload_flops=draw(st.integers(1, max(1, shape.flops // 2))),
        max_tile_flops=max(2, shape.flops // draw(st.integers(1, 64))),
        tile_mem_cap_bytes=max(3 * itemsize, whole_bytes // draw(st.integers(1, 64))),
        target_tiles=draw(st.integers(1, 16)),
        min_tile_flops=draw(st.integers(1, max(1, shape.flops // 4))),
        min_tile_side=draw(st.integers(1, 32)),
        min_tile_outputs=draw(st.integers(1, 8)),
    )
    return shape, config


@settings(max_examples=300, deadline=None)
@given(shapes_and_configs())
def test_plans_partition_the_gemm_within_limits(case: tuple[GemmShape, PlanConfig]) -> None:
    shape, config = case
    plan = plan_gemm(shape, config)
    if shape.flops < config.min_offload_flops:
        assert plan is None
        return
    if plan is None:
        # Only tiles too small to check keep a GEMM here: the whole output is, or the
        # limits force cuts below it.
        outputs = shape.batch * shape.m * shape.n
        assert outputs < config.min_tile_outputs or not fits(shape, config, shape.dims)
        return
    assert_partition(plan)
    assert_within_limits(plan, config)
    assert min(t.dims[0] * t.dims[1] * t.dims[2] for t in plan.tiles) >= config.min_tile_outputs


@settings(max_examples=300, deadline=None)
@given(shapes_and_configs())
def test_cut_order_batch_then_mn_then_k(case: tuple[GemmShape, PlanConfig]) -> None:
    shape, config = case
    plan = plan_gemm(shape, config)
    if plan is None:
        return
    gb, gm, gn, gk = plan.grid
    # bmm: M, N or K are cut only once every batch entry is its own tile.
    if gm * gn * gk > 1:
        assert gb == shape.batch
    # K is cut only when a full-K tile does not fit even at the finest sensible M/N cut.
    finest = (
        1,
        ceil_div(shape.m, max(1, shape.m // config.min_tile_side)),
        ceil_div(shape.n, max(1, shape.n // config.min_tile_side)),
        shape.k,
    )
    if plan.k_split:
        assert not fits(shape, config, finest)


@settings(max_examples=300, deadline=None)
@given(shapes_and_configs())
def test_target_tiles_and_min_tile_flops(case: tuple[GemmShape, PlanConfig]) -> None:
    shape, config = case
    plan = plan_gemm(shape, config)
    if plan is None:
        return
    smallest = min(t.flops for t in plan.tiles)
    fewest_outputs = min(t.dims[0] * t.dims[1] * t.dims[2] for t in plan.tiles)
    if len(plan.tiles) < config.target_tiles:
        fully_cut = plan.grid[:3] == shape.dims[:3]
        # One more cut would have gone below min_tile_flops or min_tile_outputs (a cut
        # shrinks the smallest tile at most 3x: floor(3/2) = 1).
        assert (
            fully_cut
            or smallest < 3 * config.min_tile_flops
            or fewest_outputs < 3 * config.min_tile_outputs
        )
    if fits(shape, config, shape.dims) and len(plan.tiles) > 1:
        # Nothing forced a cut: every cut was for target_tiles, so min_tile_flops holds.
        assert smallest >= config.min_tile_flops


@settings(max_examples=100, deadline=None)
@given(
    m=st.integers(256, 4096),
    n=st.integers(256, 4096),
    k=st.integers(256, 4096),
    target=st.integers(1, 16),
)
def test_realistic_shapes_reach_target(m: int, n: int, k: int, target: int) -> None:
    plan = plan_gemm(mm(m, n, k), PlanConfig(target_tiles=target))
    assert plan is not None
    assert len(plan.tiles) >= target
    assert not plan.k_split
    assert_within_limits(plan, PlanConfig())
