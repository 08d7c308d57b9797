"""How live GEMMs are planned (coordinator/serve/offload.py LivePlanning, TileOffload).

The cost model's own tables are in test_costmodel.py; here: which planner a pool gets,
what the offload does with the plan (send, keep a share, or run the GEMM here whole),
and --coordinator-gflops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch

import common.tensors
from common.signing import generate_private_key
from common.tensors import content_id
from coordinator.plan.estimates import DeviceEstimate, LinkModel, for_planning
from coordinator.plan.keep_home import CPU_S_PER_BYTE
from coordinator.plan.layouts import Layouts, Operand
from coordinator.plan.live import Commitments, LiveChoice, LivePlanning
from coordinator.plan.placement import PoolPlan, candidate_configs, fastest, plan_for_pool
from coordinator.plan.planner import GemmShape, PlanConfig, plan_config_for, plan_gemm
from coordinator.pool.workers import PoolView
from coordinator.serve.offload import TileOffload, operand
from coordinator.serve_options import coordinator_gflops

CONFIG = PlanConfig(min_offload_flops=1, min_tile_flops=1, target_tiles=4)
BIG = GemmShape("mm", 1, 512, 512, 512, 4)
SMALL = GemmShape("mm", 1, 96, 80, 72, 4)
HUGE = GemmShape("mm", 1, 2048, 2048, 2048, 4)
# Two workers as the server first knows them: 10 GFLOP/s claimed, links guessed (10 MB/s).
GUESSED = (
    DeviceEstimate("w1", 10e9, 10e6, 10e6, 1 << 28),
    DeviceEstimate("w2", 10e9, 10e6, 10e6, 1 << 28),
)
POOL = PoolView(workers=2, active=2, memory_cap=1 << 28, estimates=GUESSED)


def test_without_the_cost_model_or_estimates_the_grid_planner_decides() -> None:
    want = plan_gemm(BIG, CONFIG)
    assert LivePlanning(cost_model=False).plan(BIG, GUESSED, CONFIG) == LiveChoice(want)
    assert LivePlanning().plan(BIG, (), CONFIG) == LiveChoice(want)


def test_a_big_pool_is_planned_for_its_fastest_workers() -> None:
    # plan_gemm's largest tile of BIG (CONFIG: 4 tiles of 256 x 256 x 512): 67 MFLOP,
    # 1 MiB down, 256 KiB up. Seconds per device:
    #   a: 1 GFLOP/s, 1 GB/s     0.067 + 0.0013 = 0.068
    #   b: 10 GFLOP/s, 10 MB/s   0.0067 + 0.131 = 0.138
    #   c: 10 GFLOP/s, 1 GB/s    0.0067 + 0.0013 = 0.008
    #   d: like c, cap too small for the tile: last
    a = DeviceEstimate("a", 1e9, 1e9, 1e9)
    b = DeviceEstimate("b", 1e10, 1e7, 1e7)
    c = DeviceEstimate("c", 1e10, 1e9, 1e9)
    d = DeviceEstimate("d", 1e10, 1e9, 1e9, mem_cap_bytes=1 << 20)
    assert [e.worker_id for e in fastest(BIG, [d, b, a, c], CONFIG, 3)] == ["c", "a", "b"]
    crowd = [replace(e, link_samples=1) for e in (d, b, a, c)]
    few = LivePlanning(max_workers=2)
    assert few.plan(BIG, crowd, CONFIG) == few.plan(BIG, crowd[3:1:-1], CONFIG)


def direct(estimates: Sequence[DeviceEstimate]) -> PoolPlan:
    """plan_for_pool as LivePlanning() calls it, on these estimates as they are."""
    return plan_for_pool(
        BIG,
        estimates,
        local_flops_per_s=0.0,
        base=CONFIG,
        links=LinkModel(window=2, tile_overhead_s=4e-3),
        configs=candidate_configs(CONFIG),
        rule="pull",
    )


PULL = LivePlanning(rule="pull")


def test_the_cost_model_plans_with_optimistic_links_until_they_are_measured() -> None:
    choice = PULL.plan(BIG, GUESSED, CONFIG)
    plan, local = choice.plan, choice.local
    optimistic = [for_planning(e, 1.25e9) for e in GUESSED]
    assert {e.down_bps for e in optimistic} == {1.25e9}
    want = direct(optimistic)
    assert want.plan is not None and (plan, local) == (want.plan, frozenset())
    assert plan.grid == (1, 2, 1, 1)  # one tile per worker: a 4 ms tile costs more than it saves
    # Measured links (one sample is enough) are planned as measured: at 10 MB/s the
    # transfers dominate, and four tiles overlap them better (window 2) than two.
    slow = tuple(replace(e, link_samples=1) for e in GUESSED)
    plan = PULL.plan(BIG, slow, CONFIG).plan
    want = direct(slow)
    assert plan == want.plan and plan is not None and plan.grid == (1, 2, 2, 1)


def test_a_coordinator_share_keeps_tiles_here_or_the_whole_gemm() -> None:
    share = LivePlanning(coordinator_flops_per_s=10e9)
    choice = share.plan(BIG, GUESSED, CONFIG)
    assert choice.plan is not None and choice.plan.grid == (1, 2, 2, 1)
    assert len(choice.local) == 2
    assert share.plan(SMALL, GUESSED, CONFIG).all_here  # faster here, whole


class FakeServer:
    def __init__(self, pool: PoolView) -> None:
        self.pool = pool
        self.submitted: list[Any] = []
        self.kept: list[tuple[str, int, bool]] = []

    def submit(self, jobs: list[Any]) -> None:
        self.submitted.extend(jobs)

    def kept_here(self, gemm_id: str, tiles: int, finished: bool) -> None:
        self.kept.append((gemm_id, tiles, finished))


def test_the_offload_sends_the_rest_and_computes_its_share() -> None:
    loop = asyncio.new_event_loop()
    try:
        server = FakeServer(POOL)
        offload = TileOffload(
            server,
            loop,
            generate_private_key(),
            lambda *_: CONFIG,
            LivePlanning(coordinator_flops_per_s=10e9),
        )
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        done: list[torch.Tensor] = []
        assert offload.start("s0:mm", "mm", a, b, done.append)
        loop.run_until_complete(asyncio.sleep(0))  # run the callbacks handed to the loop
        assert len(server.submitted) == 2 and server.kept == [("s0:mm", 2, False)]
        assert not done  # the workers' two tiles are still out
        for job in server.submitted:
            job.gemm.deliver(job.region, job.a @ job.b)
        assert len(done) == 1
        torch.testing.assert_close(done[0], a @ b, rtol=1e-5, atol=1e-4)
        # A GEMM the coordinator would finish first runs here whole: nothing is sent.
        small_a, small_b = torch.randn(96, 72), torch.randn(72, 80)
        assert not offload.start("s0:small", "mm", small_a, small_b, done.append)
        loop.run_until_complete(asyncio.sleep(0))
        assert len(server.submitted) == 2 and len(server.kept) == 1
    finally:
        loop.close()


@pytest.mark.parametrize(
    ("value", "local_workers", "want"),
    [("0", 0, 0.0), ("12.5", 0, 12.5), ("auto", 2, 0.0)],
)
def test_coordinator_gflops_values(value: str, local_workers: int, want: float) -> None:
    assert coordinator_gflops(value, local_workers) == want


def test_coordinator_gflops_auto_measures_this_machine() -> None:
    torch.manual_seed(7)
    assert coordinator_gflops("auto", 0) > 0.1
    # The measurement draws nothing from the global generator: that stream is the job's.
    after = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(4))


@pytest.mark.parametrize("value", ["fast", "-1", "inf", "nan"])
def test_coordinator_gflops_rejects_nonsense(value: str) -> None:
    with pytest.raises(SystemExit, match="--coordinator-gflops"):
        coordinator_gflops(value, 0)


def test_plans_commit_their_workers_and_the_next_plan_waits_for_them() -> None:
    commitments = Commitments()
    share = LivePlanning(coordinator_flops_per_s=10e9)
    first = share.plan(BIG, GUESSED, CONFIG, commitments, now=100.0)
    assert first == share.plan(BIG, GUESSED, CONFIG)  # nothing committed before it
    busy = commitments.ready_at(100.0, ["w1", "w2"])
    assert busy["w1"] > 0 and busy["w2"] > 0  # both got tiles; the coordinator is not kept
    # The same GEMM again at once: both workers are busy, so the coordinator keeps more.
    second = share.plan(BIG, GUESSED, CONFIG, commitments, now=100.0)
    assert len(second.local) > len(first.local)


def test_auto_follows_earliest_finish_where_compute_binds_and_links_are_known() -> None:
    # One fast and one slow worker, measured 10 GB/s links: compute binds. "auto" is
    # the earliest-finish plan, each remote tile naming the worker it was placed on.
    fast = DeviceEstimate("fast", 100e9, 1e10, 1e10, link_samples=3)
    slow = DeviceEstimate("slow", 20e9, 1e10, 1e10, link_samples=3)
    choice = LivePlanning().plan(HUGE, (fast, slow), CONFIG)
    assert choice.plan is not None and len(choice.owners) == len(choice.plan.tiles)
    finish = LivePlanning(rule="finish").pool_plan(HUGE, (fast, slow), CONFIG, grids=[choice.plan])
    assert finish is not None and finish.plan == choice.plan
    assert choice.owners == {p.tile.index: p.worker_id for p in finish.placements}
    assert finish.makespan <= 1.5 * finish.lower_bound  # compute binds: followed
    assert set(choice.owners.values()) == {"fast", "slow"}
    # Links not measured yet: planned on the optimistic guess, so nothing is bound and
    # pull's plan is used.
    unmeasured = [replace(e, link_samples=0) for e in (fast, slow)]
    guessed = LivePlanning().plan(HUGE, unmeasured, CONFIG)
    assert guessed.owners == {} and guessed.plan == PULL.plan(HUGE, unmeasured, CONFIG).plan


def test_auto_pulls_where_links_bind_and_following_gains_little() -> None:
    # Measured 10 MB/s links: transfers dominate (far beyond 1.5x the bound) and two
    # equal workers leave pull little to lose: pull's plan, nobody named.
    slow_links = tuple(replace(e, link_samples=1) for e in GUESSED)
    choice = LivePlanning().plan(BIG, slow_links, CONFIG)
    assert choice.owners == {}
    assert choice.plan == PULL.plan(BIG, slow_links, CONFIG).plan
    # Always following, the same pool gets every tile named.
    named = LivePlanning(rule="finish").plan(BIG, slow_links, CONFIG)
    assert named.plan is not None and len(named.owners) == len(named.plan.tiles)


def test_the_coordinators_cpu_per_byte_makes_plans_that_move_fewer_bytes() -> None:
    # A GPT MLP's second projection (1024 tokens, 3072 -> 768, fp32) on two equal workers
    # on fast measured links, as on loopback, where what binds is the coordinator's CPU
    # for every byte it moves. Planned as if bytes cost nothing, each worker gets half of
    # the tokens and the whole 9 MB weight; at the server's CPU per byte, the plan moves
    # fewer bytes, however it cuts and places.
    shape = GemmShape("mm", 1, 1024, 768, 3072, 4)
    config = plan_config_for(1.0)(2, 1 << 30)
    workers = tuple(DeviceEstimate(w, 170e9, 3e9, 3e9, link_samples=5) for w in ("w1", "w2"))

    def moved(planning: LivePlanning) -> int:
        plan = planning.pool_plan(shape, workers, config)
        assert plan is not None and plan.plan is not None and not plan.local_tiles
        return plan.down_bytes + sum(p.tile.up_bytes(4) for p in plan.placements)

    free = moved(LivePlanning())
    assert free == 4 * (1024 * 3072 + 2 * 3072 * 768 + 1024 * 768)
    assert moved(LivePlanning(cpu_s_per_byte=CPU_S_PER_BYTE)) < 0.95 * free


class _Counted(Layouts):
    """Layouts that also add up the bytes each recorded plan moves."""

    def __init__(self) -> None:
        super().__init__()
        self.down = self.up = 0

    def record(
        self, shape: GemmShape, grid: Any, operands: Any, placements: Any, caps: Any
    ) -> None:
        placements = list(placements)
        self.down += sum(p.down_bytes for p in placements)
        self.up += sum(p.tile.up_bytes(shape.itemsize) for p in placements)
        super().record(shape, grid, operands, placements, caps)


class _Blind(_Counted):
    """As above, but planning as if no plan had cut anything before."""

    def variants(self, *_: Any) -> list[Any]:
        return []

    def held(self, *_: Any) -> dict[str, frozenset[Any]]:
        return {}

    def later_bytes(self, *_: Any) -> int:
        return 0


def test_a_steps_gemms_cut_their_shared_matrices_alike_and_move_fewer_bytes() -> None:
    # A two-layer MLP's step (2048 wide, 1024 tokens), as the server plans it on two
    # workers measured on loopback: each layer's forward x Wᵀ, then the second layer's
    # input gradient g W and weight gradient gᵀ x, then the first layer's weight
    # gradient (each planned when the one it waits for is done; the two gradients
    # together). Each matrix is read twice; planned knowing how the first read cut it
    # and where its blocks went, the second read finds most of it at its workers: far
    # fewer operand bytes sent, for some more partial results back.
    t, d = 1024, 2048
    workers = tuple(DeviceEstimate(w, 60e9, 200e6, 200e6, 1 << 30, link_samples=5) for w in "ab")
    config = plan_config_for(1.0)(2, 1 << 30)
    fwd, dx, dw = (GemmShape("mm", 1, *mnk, 4) for mnk in ((t, d, d), (t, d, d), (d, d, t)))
    x0, x1, w1, g1 = (Operand(name) for name in ("x0", "x1", "W1", "g1"))

    def step(layouts: Layouts) -> None:
        planning, commitments = LivePlanning(cpu_s_per_byte=CPU_S_PER_BYTE), Commitments()
        for now, shape, a, b in (
            (0.0, fwd, x0, Operand("W0", True)),
            (10.0, fwd, x1, Operand("W1", True)),
            (20.0, dx, g1, w1),
            (20.0, dw, Operand("g1", True), x1),
            (30.0, dw, Operand("g0", True), x0),
        ):
            planning.plan(
                shape, workers, config, commitments, now=now, layouts=layouts, operands=(a, b)
            )

    blind, knowing = _Blind(), _Counted()
    step(blind)
    step(knowing)
    assert knowing.down < 0.65 * blind.down
    assert knowing.down + knowing.up < 0.85 * (blind.down + blind.up)


def test_an_operand_is_named_by_the_memory_it_lies_in_whichever_way_it_is_read() -> None:
    w = torch.randn(6, 4)
    named = operand(w)
    assert named is not None and not named.transposed
    assert operand(w.t()) == Operand(named.key, transposed=True)  # the forward's Wᵀ
    assert operand(w[2:]) != named  # other memory, other sizes
    w.add_(1.0)  # an optimizer step: the same memory holds another matrix now
    assert operand(w) != named
    with torch.inference_mode():
        assert operand(torch.ones(2, 2)) is None  # no version to tell changes by


@pytest.mark.parametrize(
    ("names", "hashed_again"),
    [
        (("s0:mm", "s0:mm_1"), False),  # a traced step's GEMMs
        (("s0:eager_mm_0", "s0:eager_mm_1"), True),  # user code ran between them
        (("s0:mm", "s1:mm"), True),  # another step
    ],
)
def test_a_traced_steps_blocks_cut_again_are_not_hashed_again(
    monkeypatch: pytest.MonkeyPatch, names: tuple[str, str], hashed_again: bool
) -> None:
    hashed: list[int] = []

    def counting(t: torch.Tensor) -> str:
        hashed.append(t.numel() * t.element_size())
        return content_id(t)

    monkeypatch.setattr(common.tensors, "content_id", counting)
    loop = asyncio.new_event_loop()
    try:
        server = FakeServer(POOL)
        offload = TileOffload(
            server,
            loop,
            generate_private_key(),
            lambda *_: CONFIG,
            LivePlanning(),
            clock=lambda: 0.0,
        )
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        for name in names:  # the same product twice: some blocks are cut alike
            assert offload.start(name, "mm", a, b, lambda _: None)
        loop.run_until_complete(asyncio.sleep(0))
        # Each GEMM's distinct blocks (content id -> bytes); random data: one content,
        # one block.
        cut: dict[str, dict[str, int]] = {name: {} for name in names}
        for job in server.submitted:
            for block in (job.a_block, job.b_block):
                cut[job.gemm.gemm_id][block.id] = block.nbytes
        each = sum(sum(blocks.values()) for blocks in cut.values())
        distinct = sum({k: v for blocks in cut.values() for k, v in blocks.items()}.values())
        assert distinct < each  # the second GEMM cut some blocks as the first did
        assert sum(hashed) == (each if hashed_again else distinct)
    finally:
        loop.close()
