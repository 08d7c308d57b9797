"""Cost model: exact tables for tile times, online updates and list-scheduled plans.

Sizes are tiny and speeds powers of two so every makespan below is exact in floats and
was computed by hand (the walk-throughs are in the comments).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from common.messages import DeviceProfile
from coordinator.plan import placement
from coordinator.plan.estimates import (
    UNMEASURED_FLOPS_PER_S,
    DeviceEstimate,
    LinkModel,
    TileObservation,
    for_planning,
    from_profile,
    lower_bound,
    observe,
    overdue_finish,
    queued_start,
)
from coordinator.plan.live import Commitments
from coordinator.plan.placement import (
    LOCAL,
    Placement,
    PoolPlan,
    candidate_configs,
    candidate_plans,
    place_tiles,
    plan_for_pool,
)
from coordinator.plan.planner import GemmShape, PlanConfig, grid_plan, plan_gemm

# C[4, 4] = A[4, 2] @ B[2, 4], one byte per element: 64 FLOPs.
SHAPE = GemmShape("mm", 1, 4, 4, 2, 1)
TINY = PlanConfig(min_offload_flops=1, min_tile_flops=1, min_tile_outputs=1)
# fast: compute 8 FLOP/s; slow 4. Both: downlink 8 B/s, uplink 4 B/s (2x asymmetry).
FAST = DeviceEstimate("fast", 8.0, 8.0, 4.0)
SLOW = DeviceEstimate("slow", 4.0, 8.0, 4.0)


def four_tiles() -> list:  # type: ignore[type-arg]
    plan = plan_gemm(
        SHAPE, PlanConfig(min_offload_flops=1, min_tile_flops=1, min_tile_outputs=1, target_tiles=4)
    )
    assert plan is not None and plan.grid == (1, 2, 2, 1)
    return list(plan.tiles)  # each 2x2x2: 16 FLOPs, operands 4 + 4 bytes, result 4 bytes


def test_tile_seconds_adds_the_three_phases() -> None:
    # 1 MB down at 1 MB/s + 8 GFLOP at 4 GFLOP/s + 0.5 MB up at 1 MB/s
    device = DeviceEstimate("d", 4e9, 1e6, 1e6)
    assert device.tile_seconds(8_000_000_000, 1_000_000, 500_000) == 3.5


def test_from_profile() -> None:
    measured = DeviceProfile(gflops=100.0, mem_cap_bytes=1 << 20)
    est = from_profile("w", measured, down_bps=1e7, up_bps=2e6, now=5.0)
    assert est == DeviceEstimate("w", 1e11, 1e7, 2e6, 1 << 20, 5.0)
    unmeasured = from_profile("u", DeviceProfile(), down_bps=1.0, up_bps=1.0, now=0.0)
    assert (unmeasured.flops_per_s, unmeasured.mem_cap_bytes) == (UNMEASURED_FLOPS_PER_S, None)


@pytest.mark.parametrize(
    ("now", "expected_flops"),
    [
        (0.0, 150.0),  # back to back: weight alpha = 0.5
        (60.0, 175.0),  # one half-life stale: weight 1 - 0.5 * 0.5 = 0.75
    ],
)
def test_observe_ewma(now: float, expected_flops: float) -> None:
    est = DeviceEstimate("d", 100.0, 10.0, 10.0)
    # 200 FLOPs in 1 s; 40 bytes down in 2 s; upload not measured.
    obs = TileObservation(200, 40, 8, down_s=2.0, compute_s=1.0, up_s=None)
    new = observe(est, obs, now, alpha=0.5, half_life_s=60.0)
    assert new.flops_per_s == expected_flops
    assert new.down_bps == 10.0 + (20.0 - 10.0) * (expected_flops - 100.0) / 100.0
    assert new.up_bps == 10.0  # no measurement, no change
    assert new.updated_at == now


def test_observe_learns_a_straggler() -> None:
    est = DeviceEstimate("d", 1000.0, 1.0, 1.0)
    obs = TileObservation(100, 0, 0, down_s=None, compute_s=1.0, up_s=None)  # 100 FLOP/s
    for _ in range(10):
        est = observe(est, obs, 0.0, alpha=0.5)
    assert 100.0 < est.flops_per_s < 101.0  # 100 + 900 / 2**10


@pytest.mark.parametrize(("now", "finish"), [(5.0, 14.0), (14.0, 14.0), (20.0, 30.0)])
def test_overdue_finish(now: float, finish: float) -> None:
    # Started at 10 and expected to take 4 s; at 20 it has run 10 s: assume 10 more.
    assert overdue_finish(10.0, 4.0, now) == finish


def test_a_tile_sent_behind_another_starts_when_that_one_is_back() -> None:
    # Sent at 10 behind a tile that came back at 12: its 4 s count from 12, so at 14 it
    # is due at 16, not overdue since 14.
    assert queued_start(10.0, 12.0) == 12.0 and queued_start(10.0, 3.0) == 10.0
    assert overdue_finish(queued_start(10.0, 12.0), 4.0, 14.0) == 16.0


def test_pipelined_seconds_is_the_slowest_phase() -> None:
    # FAST, a 16-FLOP tile with 8 bytes down and 4 up: 1 s down, 2 s compute, 1 s up.
    assert FAST.tile_seconds(16, 8, 4) == 4.0
    assert FAST.pipelined_seconds(16, 8, 4) == 2.0
    assert FAST.pipelined_seconds(16, 80, 4) == 10.0


def test_lower_bound() -> None:
    assert lower_bound(64, [FAST, SLOW]) == 64 / 12
    with pytest.raises(ValueError):
        lower_bound(64, [])


def test_place_tiles_two_devices_reuse_operand_blocks() -> None:
    # fast fresh tile: 8/8 + 16/8 + 4/4 = 4 s; with one operand held 3.5 s.
    # slow fresh tile: 8/8 + 16/4 + 4/4 = 6 s; with one held 5.5 s.
    # t00 -> fast [0, 4]; t01: fast (holds A0) 7.5 vs slow 6 -> slow [0, 6];
    # t10: fast (holds B0) 7.5 vs slow 12 -> fast [4, 7.5];
    # t11: fast (holds A1) 11 vs slow (holds B1) 11.5 -> fast [7.5, 11].
    placed = place_tiles(SHAPE, four_tiles(), [FAST, SLOW])
    assert placed is not None
    table = [(p.tile.index[1:3], p.worker_id, p.start, p.finish, p.down_bytes) for p in placed]
    assert table == [
        ((0, 0), "fast", 0.0, 4.0, 8),
        ((0, 1), "slow", 0.0, 6.0, 8),
        ((1, 0), "fast", 4.0, 7.5, 4),
        ((1, 1), "fast", 7.5, 11.0, 4),
    ]


def test_place_tiles_respects_memory_caps() -> None:
    # Each tile needs 12 bytes: fast (cap 10) can take none, so slow takes all four:
    # 6 + 5.5 (holds A0) + 5.5 (holds B0) + 5 (holds A1 and B1) = 22.
    capped = DeviceEstimate("fast", 8.0, 8.0, 4.0, mem_cap_bytes=10)
    placed = place_tiles(SHAPE, four_tiles(), [capped, SLOW])
    assert placed is not None
    assert [(p.worker_id, p.finish) for p in placed] == [
        ("slow", 6.0),
        ("slow", 11.5),
        ("slow", 17.0),
        ("slow", 22.0),
    ]
    assert place_tiles(SHAPE, four_tiles(), [capped]) is None


def test_place_tiles_starts_from_ready_times() -> None:
    placed = place_tiles(SHAPE, four_tiles()[:1], [FAST, SLOW], ready_at={"fast": 3.0})
    assert placed is not None
    assert [(p.worker_id, p.start, p.finish) for p in placed] == [("slow", 0.0, 6.0)]


def test_placing_stops_once_a_tile_would_finish_after_the_plan_to_beat() -> None:
    # The walk-through above: its last tile finishes at 11.
    assert place_tiles(SHAPE, four_tiles(), [FAST, SLOW], beat=11.0) is not None
    assert place_tiles(SHAPE, four_tiles(), [FAST, SLOW], beat=10.5) is None
    assert place_tiles(SHAPE, four_tiles(), [FAST, SLOW], beat=5.0) is None  # at the 2nd


def test_grids_that_cannot_beat_the_best_are_given_up_with_the_same_plan_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each grid is placed tile by tile: once a tile of a grid finishes later than the
    # best plan so far, the rest of that grid need not be placed, and the plan chosen
    # is the one a placement of every grid chooses.
    shape = GemmShape("mm", 1, 512, 512, 512, 4)
    config = PlanConfig(min_offload_flops=1, min_tile_flops=1, min_tile_outputs=1)
    devices = [
        DeviceEstimate(f"d{i}", 1e9 * (1 + i % 7), 1e7 * (1 + i % 3), 1e7, None, 0.0, 1)
        for i in range(40)
    ]
    real = placement.place_tiles
    given_up: list[bool] = []

    def pruned(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        given_up.append(result is None)
        return result

    def every_tile(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("beat")
        return real(*args, **kwargs)

    monkeypatch.setattr(placement, "place_tiles", pruned)
    chosen = plan_for_pool(shape, devices, local_flops_per_s=0.0, base=config, rule="pull")
    assert chosen.plan is not None and any(given_up) and not all(given_up)
    monkeypatch.setattr(placement, "place_tiles", every_tile)
    assert plan_for_pool(shape, devices, local_flops_per_s=0.0, base=config, rule="pull") == chosen


def test_candidate_grids() -> None:
    grids = [plan.grid for plan in candidate_plans(SHAPE, [FAST, SLOW], TINY)]
    assert grids == [(1, 1, 1, 1), (1, 2, 1, 1), (1, 2, 2, 1), (1, 4, 2, 1)]


def test_plan_for_pool_one_device_tie_keeps_fewest_tiles() -> None:
    # 1 tile: 16/8 + 64/8 + 16/4 = 14. 2 tiles: 7.5 + 6.5 (B held) = 14.
    # 4 tiles: 4 + 3.5 + 3.5 + 3 = 14. All tie: the single tile moves the fewest bytes.
    pool = plan_for_pool(SHAPE, [FAST], local_flops_per_s=1.0, base=TINY)
    assert pool.plan is not None and pool.plan.grid == (1, 1, 1, 1)
    assert (pool.makespan, pool.lower_bound, pool.local_seconds) == (14.0, 8.0, 64.0)


def test_plan_for_pool_two_devices_picks_eight_tiles() -> None:
    # Makespans by grid: 1 tile 14 (fast), 2 tiles 11.5, 4 tiles 11 (table above),
    # 8 tiles (1x2x2 each: fast 2.25 fresh, slow 3.25 fresh) 9.5:
    #   fast [0,2.25] t00, slow [0,3.25] t01, fast [2.25,4] t10, fast [4,6] t11 (tie
    #   with slow at 6 goes to the first device), slow [3.25,6.5] t20, fast [6,7.75] t21,
    #   slow [6.5,9.25] t30, fast [7.75,9.5] t31.
    pool = plan_for_pool(SHAPE, [FAST, SLOW], local_flops_per_s=4.0, base=TINY)
    assert pool.plan is not None and pool.plan.grid == (1, 4, 2, 1)
    assert pool.makespan == 9.5
    assert [p.finish for p in pool.placements] == [2.25, 3.25, 4.0, 6.0, 6.5, 7.75, 9.25, 9.5]
    assert pool.down_bytes == 30
    assert pool.makespan / pool.lower_bound == 9.5 / (64 / 12)


def test_plan_for_pool_runs_locally_when_that_is_faster() -> None:
    pool = plan_for_pool(SHAPE, [FAST, SLOW], local_flops_per_s=8.0, base=TINY)  # 8 s < 9.5
    assert (pool.plan, pool.placements, pool.makespan) == (None, (), 8.0)
    empty = plan_for_pool(SHAPE, [], local_flops_per_s=8.0, base=TINY)
    assert empty.plan is None
    small = plan_for_pool(SHAPE, [FAST], local_flops_per_s=1.0)  # below min_offload_flops
    assert small.plan is None and small.makespan == 64.0


# ---- pipelined workers, the coordinator's uplink, the coordinator's own share ----------


def test_window_two_overlaps_download_with_compute() -> None:
    # FAST alone, window 2 (the server's prefetch): a tile may download while the one
    # before computes. Fresh tile: down 1 s, compute 2 s, up 1 s.
    #   t00: down [0,1], compute [1,3], up [3,4]
    #   t01 (A0 held, B1 0.5 s): down [1,1.5], compute [3,5], up [5,6]
    #   t10 (B0 held): may be sent once t00 is back (4): down [4,4.5], compute [5,7], up [7,8]
    #   t11 (both held): sent at 6 (t01 back), nothing to download, compute [7,9], up [9,10]
    # In a row (window 1) the same tiles take 4 + 3.5 + 3.5 + 3 = 14 s.
    placed = place_tiles(SHAPE, four_tiles(), [FAST], links=LinkModel(window=2))
    assert placed is not None
    assert [(p.start, p.finish, p.down_bytes) for p in placed] == [
        (0.0, 4.0, 8),
        (1.0, 6.0, 4),
        (4.0, 8.0, 4),
        (6.0, 10.0, 0),
    ]
    in_a_row = place_tiles(SHAPE, four_tiles(), [FAST])
    assert in_a_row is not None and in_a_row[-1].finish == 14.0


# As above with the coordinator's uplink at 4 B/s: a download cannot end before the
# uplink carried every byte placed so far (8, 12, 16, 16 bytes -> 2, 3, 4, 4 s).
#   t00: down ends max(1, 2) = 2, compute [2,4], up [4,5]
#   t01: down from 2, ends max(2.5, 3) = 3, compute [4,6], up [6,7]
#   t10: sent at 5 (t00 back), ends max(5.5, 4) = 5.5, compute [6,8], up [8,9]
#   t11: sent at 7, no bytes, compute [8,10], up [10,11]
UPLINK = (LinkModel(2, egress_bps=4.0), [(0.0, 5.0), (2.0, 7.0), (5.0, 9.0), (7.0, 11.0)])
# Or with the coordinator spending 0.25 s per byte a tile moves (operands sent, result
# back; the first tile's 8 + 4, then 4 + 4, 4 + 4, 0 + 4): a download cannot end before
# it has handled those of the tiles placed so far and this one.
#   t00: handled 12 -> 3 s; down ends max(1, 3) = 3, compute [3,5], up [5,6]
#   t01: 20 -> 5; sent at 3, ends max(3.5, 5) = 5, compute [5,7], up [7,8]
#   t10: 28 -> 7; sent at 6 (t00 back), ends max(6.5, 7) = 7, compute [7,9], up [9,10]
#   t11: 32 -> 8; sent at 8, no bytes, ends 8, compute [9,11], up [11,12]
CPU = (LinkModel(2, byte_cpu_s=0.25), [(0.0, 6.0), (3.0, 8.0), (6.0, 10.0), (8.0, 12.0)])


@pytest.mark.parametrize(("links", "want"), [UPLINK, CPU], ids=["uplink", "cpu per byte"])
def test_the_coordinators_uplink_and_cpu_are_shared(
    links: LinkModel, want: list[tuple[float, float]]
) -> None:
    placed = place_tiles(SHAPE, four_tiles(), [FAST], links=links)
    assert placed is not None
    assert [(p.start, p.finish) for p in placed] == want


@pytest.mark.parametrize("bad", [{"window": 0}, {"egress_bps": 0.0}, {"byte_cpu_s": -1.0}])
def test_a_link_model_rejects_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LinkModel(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("rule", ["finish", "pull"])
def test_the_coordinator_takes_a_share(rule: str) -> None:
    # The coordinator (4 FLOP/s, no link) as a device next to FAST, tiles in a row. By
    # either rule it keeps a tile when it would finish it no later than FAST (which, by
    # "pull", is the worker that would pull it):
    #   t00: coordinator 4 ties FAST 4 -> coordinator (first), sends nothing
    #   t01: coordinator 8 vs FAST fresh 4 -> FAST [0,4]
    #   t10: coordinator 8 ties FAST fresh 4 + 4 = 8 -> coordinator (holds B0) [4,8]
    #   t11: coordinator 12 vs FAST (holds B1) 4 + 3.5 -> FAST [4,7.5]
    # ("pull" places t11 before t10: FAST, free first, prefers the tile whose block it
    # holds; the outcome is the same.)
    coordinator = DeviceEstimate(LOCAL, 4.0, math.inf, math.inf)
    placed = place_tiles(SHAPE, four_tiles(), [coordinator, FAST], rule=rule)
    assert placed is not None
    table = sorted(
        (p.tile.index[1:3], p.worker_id, p.start, p.finish, p.down_bytes) for p in placed
    )
    assert table == [
        ((0, 0), LOCAL, 0.0, 4.0, 0),
        ((0, 1), "fast", 0.0, 4.0, 8),
        ((1, 0), LOCAL, 4.0, 8.0, 0),
        ((1, 1), "fast", 4.0, 7.5, 4),
    ]


def test_plan_for_pool_shares_with_the_coordinator() -> None:
    # Grids for one device: 1 tile -> FAST 14 (coordinator 16); 2 tiles (2x4x2: 12 bytes
    # down, 32 FLOPs, 8 bytes up) -> FAST 1.5 + 4 + 2 = 7.5, then the coordinator 8
    # (FAST would need 14): makespan 8; 4 tiles -> 8 as above. The tie keeps 2 tiles.
    pool = plan_for_pool(SHAPE, [FAST], local_flops_per_s=4.0, base=TINY, share_local=True)
    assert pool.plan is not None and pool.plan.grid == (1, 2, 1, 1)
    assert [(p.worker_id, p.finish) for p in pool.placements] == [("fast", 7.5), (LOCAL, 8.0)]
    assert pool.local_tiles == (pool.plan.tiles[1],)
    assert (pool.makespan, pool.lower_bound, pool.local_seconds) == (8.0, 64 / 12, 16.0)
    alone = plan_for_pool(SHAPE, [FAST], local_flops_per_s=4.0, base=TINY)
    assert (alone.makespan, alone.lower_bound, alone.local_tiles) == (14.0, 8.0, ())


def test_pull_rule_hands_tiles_to_the_first_free_slot() -> None:
    # Grid order, each tile to the device free first (ties to the first device):
    #   t00 FAST [0,4]; t01 SLOW (free at 0) fresh [0,6]; t10 FAST (free at 4, holds B0)
    #   [4,7.5]; t11 SLOW (free at 6, holds B1: 0.5 + 4 + 1) [6,11.5].
    # Earliest finish placed the same tiles by 11 (test above).
    placed = place_tiles(SHAPE, four_tiles(), [FAST, SLOW], rule="pull")
    assert placed is not None
    assert [(p.worker_id, p.finish) for p in placed] == [
        ("fast", 4.0),
        ("slow", 6.0),
        ("fast", 7.5),
        ("slow", 11.5),
    ]
    with pytest.raises(ValueError):
        place_tiles(SHAPE, four_tiles(), [FAST], rule="random")


def test_candidate_configs_add_bigger_tiles_and_k_splits() -> None:
    configs = candidate_configs(PlanConfig())
    assert [(c.max_tile_flops >> 31, c.min_tile_side) for c in configs] == [
        (1, 256),
        (1, 1024),
        (4, 256),
        (4, 1024),
        (16, 1024),
    ]
    # A long-K GEMM: the base limits cut M and N to 256-wide strips; with a smallest side
    # of 1024 K is split instead, and each tile carries 4x the FLOPs per byte.
    long_k = GemmShape("mm", 1, 8192, 2048, 16384, 4)
    grids = {p.grid for p in candidate_plans(long_k, [FAST], PlanConfig(), configs=configs)}
    assert (1, 32, 8, 1) in grids and (1, 8, 2, 16) in grids


def test_links_count_as_measured_after_a_timed_transfer() -> None:
    est = DeviceEstimate("w", 1e9, 1e6, 1e6)
    no_transfer = TileObservation(1000, 0, 0, None, 1e-6, None)
    assert observe(est, no_transfer, 0.0).link_samples == 0
    timed = TileObservation(1000, 1000, 1000, 1e-3, 1e-6, 1e-3)
    assert observe(observe(est, timed, 0.0), timed, 0.0).link_samples == 2


def test_planning_assumes_fast_links_until_one_is_measured() -> None:
    guessed = DeviceEstimate("w", 1e9, 1e6, 2e6)
    assert for_planning(guessed, 1e9) == DeviceEstimate("w", 1e9, 1e9, 1e9)
    measured = DeviceEstimate("w", 1e9, 1e6, 2e6, link_samples=1)
    assert for_planning(measured, 1e9) is measured


def test_a_coordinator_that_computes_nothing_never_runs_a_gemm_locally() -> None:
    pool = plan_for_pool(SHAPE, [FAST], local_flops_per_s=0.0, base=TINY)
    assert pool.plan is not None and pool.local_seconds == math.inf
    nobody = plan_for_pool(SHAPE, [], local_flops_per_s=0.0, base=TINY)
    assert nobody.plan is None and nobody.makespan == math.inf
    with pytest.raises(ValueError):
        plan_for_pool(SHAPE, [FAST], local_flops_per_s=0.0, base=TINY, share_local=True)


def test_commitments_delay_the_next_plan_until_planned_work_is_done() -> None:
    # FAST alone, window 1: 4 tiles planned at t=10 finish at 14, 17.5, 21, 24 (14 s
    # from the earlier table, shifted). A GEMM planned at t=12 sees FAST busy for 12 s
    # more; the coordinator's own share is never committed (it computes it at once).
    placed = place_tiles(SHAPE, four_tiles(), [FAST])
    assert placed is not None
    coordinator_tile = Placement(four_tiles()[0], LOCAL, 0.0, 99.0, 0)
    chosen = PoolPlan(None, (*placed, coordinator_tile), 14.0, 8.0, 64.0)
    commitments = Commitments()
    commitments.add(10.0, chosen)
    assert commitments.ready_at(12.0, ["fast", "slow"]) == {"fast": 12.0, "slow": 0.0}
    assert commitments.ready_at(30.0, ["fast"]) == {"fast": 0.0}
    commitments.forget(["slow"])
    assert commitments.ready_at(12.0, ["fast"]) == {"fast": 0.0}
    # A plan made while FAST is busy for 12 s starts its tiles at 12.
    later = plan_for_pool(SHAPE, [FAST], local_flops_per_s=1.0, base=TINY, ready_at={"fast": 12.0})
    assert later.makespan == 26.0 and later.placements[0].start == 12.0


def test_pull_hands_a_worker_a_tile_whose_block_it_holds_before_the_head() -> None:
    # FAST, free first, holds B1 (sent for an earlier GEMM): of the queue t00 t01 t10
    # t11 it takes t01, and is sent its A0 alone; as the scheduler prefers.
    tiles = four_tiles()
    b1 = placement.operand_blocks(SHAPE, tiles[1])[1][0]
    other = DeviceEstimate("other", 8.0, 8.0, 4.0)
    placed = place_tiles(SHAPE, tiles, [FAST, other], held={"fast": frozenset({b1})}, rule="pull")
    assert placed is not None
    assert (placed[0].worker_id, placed[0].tile.index, placed[0].down_bytes) == (
        "fast",
        tiles[1].index,
        4,
    )
    blind = place_tiles(SHAPE, tiles, [FAST, other], rule="pull")
    assert blind is not None and blind[0].tile.index == tiles[0].index


def test_counting_cpu_picks_the_plan_that_moves_fewest_bytes_near_the_fastest() -> None:
    # One tile on one worker moves each operand once; four tiles on two workers finish
    # sooner but send each worker a row block of A and a column block of B for each tile.
    other = DeviceEstimate("other", 8.0, 8.0, 4.0)
    whole = grid_plan(SHAPE, (1, 1, 1, 1), TINY)
    four = plan_gemm(
        SHAPE, PlanConfig(min_offload_flops=1, min_tile_flops=1, min_tile_outputs=1, target_tiles=4)
    )
    assert whole is not None and four is not None and len(four.tiles) == 4

    def chosen(**kw: Any) -> PoolPlan:
        return plan_for_pool(SHAPE, [FAST, other], local_flops_per_s=0, grids=[four, whole], **kw)

    fastest = chosen()
    one = plan_for_pool(SHAPE, [FAST, other], local_flops_per_s=0, grids=[whole])
    assert fastest.plan == four and one.makespan > fastest.makespan
    slower_by = one.makespan / fastest.makespan
    assert one.down_bytes < fastest.down_bytes
    # Within the slack the frugal plan wins; outside it, the fastest still does.
    assert chosen(byte_cost_s=1.0, cpu_slack=slower_by).plan == whole
    assert chosen(byte_cost_s=1.0, cpu_slack=0.99 * slower_by).plan == four
    # What a grid costs later GEMMs counts with its own bytes.
    later = {four.grid: 0.0, whole.grid: 1e3}
    assert chosen(byte_cost_s=1.0, cpu_slack=slower_by, later=lambda p: later[p.grid]).plan == four
