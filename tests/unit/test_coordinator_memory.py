"""The coordinator's core and real worker sessions, joined in memory (``memory_pool``).

What the loopback tests used to show over sockets, shown without them: GEMMs cut by
``TiledGemm`` and training steps cut by ``TileOffload`` come back whole and equal to
torch; cheats are caught and banned by key; workers that leave or fall silent have
their tiles finished by the others; credit reaches the worker.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from support.memory_pool import PROFILE, Answer, FakeClock, MemoryPool
from torch import nn

from common.errors import ErrorCode
from common.messages import Error
from common.signing import fingerprint, generate_private_key
from coordinator.plan.live import LivePlanning
from coordinator.plan.planner import GemmShape, PlanConfig, plan_gemm
from coordinator.pool.effects import CloseCode
from coordinator.pool.ledger import Contribution
from coordinator.schedule.scheduler import SchedulerConfig
from coordinator.serve.offload import TileOffload
from coordinator.step.cpu_costs import COSTS
from coordinator.step.executor import DataflowExecutor
from coordinator.step.job import Job
from coordinator.step.tracing import trace_step
from coordinator.tiles.tiled_gemm import TiledGemm

pytestmark = pytest.mark.timeout(60)

PLAN = PlanConfig(min_offload_flops=1, min_tile_flops=1, target_tiles=8)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[MemoryPool]:
    memory = MemoryPool(tmp_path)
    yield memory
    memory.close()


class Gemm:
    """One GEMM cut into signed tiles; ``out`` holds the assembled product once done."""

    def __init__(self, pool: MemoryPool, gemm_id: str, shape: tuple[int, int, int], seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        m, k, n = shape
        self.a, self.b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        plan = plan_gemm(GemmShape("mm", 1, m, n, k, 4), PLAN)
        assert plan is not None
        self.out: list[torch.Tensor] = []
        self.tiled = TiledGemm(gemm_id, plan, self.a, self.b, self.out.append)
        self.tiles = list(self.tiled.iter_tiles(pool.key))
        pool.submit(self.tiles)

    @property
    def done(self) -> bool:
        return bool(self.out)

    def check(self) -> None:
        [out] = self.out
        want = self.a @ self.b
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def ledger_row(pool: MemoryPool, name: str) -> Contribution:
    rows = [c for c in pool.ledger.all() if c.name == name]
    assert len(rows) <= 1, rows
    return rows[0] if rows else Contribution("", name)


# ---- workers, results and credit ----------------------------------------------------------


def test_two_workers_share_a_gemm_and_each_is_credited_for_its_tiles(pool: MemoryPool) -> None:
    alice, bob = pool.join("alice"), pool.join("bob", cache_bytes=1 << 20)
    gemm = Gemm(pool, "g", (96, 80, 72))
    gemm.check()
    counters = pool.core.counters
    assert counters.tiles_verified == counters.tiles_sent == len(gemm.tiles)
    assert (counters.rejected, counters.refused, counters.duplicates) == (0, 0, 0)
    rows = {name: ledger_row(pool, name) for name in ("alice", "bob")}
    assert rows["alice"].tiles == len(alice.tasks) > 0 and rows["bob"].tiles == len(bob.tasks) > 0
    assert rows["alice"].flops + rows["bob"].flops == sum(job.flops for job in gemm.tiles)
    # Bob's cache: tiles that share a block of A or B send it to him once.
    assert bob.session.cached_blocks > 0
    assert pool.core.tiles == {} and pool.core.scheduler.pending() == 0


def test_a_gemm_is_handed_back_only_once_its_last_tile_is_credited(pool: MemoryPool) -> None:
    pool.join("dave")
    credited_at_release: list[int] = []
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(64, 48, generator=g), torch.randn(48, 40, generator=g)
    plan = plan_gemm(GemmShape("mm", 1, 64, 40, 48, 4), PLAN)
    assert plan is not None
    tiled = TiledGemm(
        "g", plan, a, b, lambda out: credited_at_release.append(ledger_row(pool, "dave").tiles)
    )
    jobs = list(tiled.iter_tiles(pool.key))
    pool.submit(jobs)
    # The step that waits for this GEMM goes on only after the credit of every tile it
    # used is made: a coordinator stopped then loses none of it.
    assert credited_at_release == [len(jobs)]


def test_a_worker_sees_its_credit_in_the_heartbeat_ack(pool: MemoryPool) -> None:
    carol = pool.join("carol")
    Gemm(pool, "g", (64, 32, 48)).check()
    carol.heartbeat()
    want = ledger_row(pool, "carol")
    assert carol.session.stats.credit_tiles == want.tiles == len(carol.tasks)
    assert carol.session.stats.credit_gflop == pytest.approx(want.gflop, abs=1e-6)


def test_wrong_results_are_rejected_reissued_and_the_cheat_is_banned_by_key(
    pool: MemoryPool,
) -> None:
    cheat_key = generate_private_key()
    pool.join("honest")
    cheat = pool.join("cheat", window=2, key=cheat_key, answer=Answer.WRONG)
    gemms = []
    for i in range(8):  # the cheat gets fewer tiles than it has window: a few GEMMs
        gemms.append(Gemm(pool, f"g{i}", (96, 64, 80), seed=4 + i))
        if cheat.closed:
            break
    for gemm in gemms:
        gemm.check()
    counters = pool.core.counters
    # Three quick failures ban (ReputationPolicy); the ban closes the connection.
    assert cheat.closed is not None and cheat.closed[0] == CloseCode.POLICY
    assert counters.rejected == 3 and counters.banned == 1
    assert pool.core.scheduler.stats.reissued >= 3
    tiles = sum(len(gemm.tiles) for gemm in gemms)
    assert counters.tiles_verified == tiles
    row = ledger_row(pool, "cheat")
    assert (row.tiles, row.rejected) == (0, 3)
    assert row.reputation < 0.2 and "3 results failed" in row.banned_reason
    assert ledger_row(pool, "honest").tiles == tiles
    assert ledger_row(pool, "honest").reputation == 1.0
    assert pool.status()["banned"] == [
        {"key": fingerprint(cheat_key), "name": "cheat", "reason": row.banned_reason}
    ]
    # The ban follows the key: under any name, the handshake turns it away, and the
    # worker's session stops for good.
    again = pool.join("a-new-name", key=cheat_key)
    assert again.closed is not None and again.closed[0] == CloseCode.POLICY
    error = again.received[-1]
    assert isinstance(error, Error) and error.code == ErrorCode.BANNED
    assert again.session.phase.value == "refused"
    assert ledger_row(pool, "a-new-name").tiles == 0


@pytest.mark.parametrize("bye", [False, True])
def test_tiles_of_a_worker_that_leaves_are_finished_by_the_other(
    pool: MemoryPool, bye: bool
) -> None:
    pool.join("stays")
    leaves = pool.join("leaves", window=2, answer=Answer.HOLD)
    gemm = Gemm(pool, "g", (96, 64, 80), seed=5)
    held = leaves.held  # small tiles share its window's slots: more than 2
    assert held >= 2 and not gemm.done
    leaves.leave(bye=bye)
    if bye:
        assert leaves.closed == (CloseCode.NORMAL, "bye")
    gemm.check()
    assert pool.core.scheduler.stats.reissued >= held
    assert ledger_row(pool, "leaves").tiles == 0
    assert ledger_row(pool, "stays").tiles == len(gemm.tiles)
    assert [w.name for w in pool.workers.values()] == ["stays"]


def test_a_silent_worker_is_dropped_at_its_timeout_and_its_tiles_finished(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    pool = MemoryPool(tmp_path, clock=clock, scheduler=SchedulerConfig(heartbeat_timeout_s=1.0))
    try:
        alive = pool.join("alive")
        silent = pool.join("silent", window=2, answer=Answer.HOLD)
        gemm = Gemm(pool, "g", (96, 64, 80), seed=6)
        assert silent.held == 2
        for _ in range(3):  # 0.6 s apart: alive keeps beating, silent says nothing
            clock.advance(0.6)
            alive.heartbeat()
            pool.tick()
            if silent.closed:
                break
        assert silent.closed == (CloseCode.TIMEOUT, "heartbeat timeout")
        assert clock.t == pytest.approx(101.2)  # at the first tick past its timeout
        gemm.check()
        assert ledger_row(pool, "alive").tiles == len(gemm.tiles)
    finally:
        pool.close()


# ---- the offload: a training step through the pool -----------------------------------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(48, 64)
        self.fc2 = nn.Linear(64, 64, bias=False)
        self.out = nn.Linear(64, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc2(F.relu(self.fc1(x)))))


class WideMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(256, 512)
        self.fc2 = nn.Linear(512, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def traced_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[Any, list[Any], list[torch.Tensor]]:
    """A cross-entropy step traced for the executor, its flat inputs, and what eager
    autograd computes for it (gradients, then the loss)."""
    job = Job(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), [(x, y)])
    traced = trace_step(job, x, y)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    want = [p.grad.clone() for p in model.parameters()] + [loss.detach()]
    flat = [p.detach() for p in model.parameters()] + list(model.buffers())
    flat += pytree.tree_leaves((x, y))
    return traced, flat, want


def record_submissions(pool: MemoryPool, blocks: dict[Any, int] | None = None) -> list[str]:
    """The ids of the tiles the offload hands to ``pool`` from now on; ``blocks`` gets
    the bytes of each distinct operand block of each GEMM."""
    submitted: list[str] = []
    submit = pool.submit

    def recording_submit(jobs: list[Any]) -> None:
        submitted.extend(job.tile_id for job in jobs)
        if blocks is not None:
            for job in jobs:
                blocks[(job.gemm.gemm_id, "a", job.region.index[:2], job.region.index[3])] = (
                    job.a_block.nbytes
                )
                blocks[(job.gemm.gemm_id, "b", job.region.index[0], job.region.index[2:])] = (
                    job.b_block.nbytes
                )
        submit(jobs)

    pool.submit = recording_submit  # type: ignore[method-assign]
    return submitted


async def run_offloaded(
    pool: MemoryPool, planning: LivePlanning, traced: Any, flat: list[Any], label: str
) -> tuple[list[Any], Any]:
    """Run a traced step through a TileOffload on ``pool``: the executor on its own
    thread, the pool on this event loop (as the server runs them)."""
    offload = TileOffload(
        pool,
        asyncio.get_running_loop(),
        pool.key,
        lambda workers, *_: replace(PLAN, target_tiles=2 * workers),  # ~2 tiles per worker
        planning,
    )
    cancel = threading.Event()
    try:
        executor = DataflowExecutor(offload, poll_s=0.01)
        return await asyncio.wait_for(
            asyncio.to_thread(executor.run, traced, flat, cancel, label), 30
        )
    finally:
        cancel.set()


def assert_outputs_match(got: list[Any], want: list[torch.Tensor]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"output {i}")


async def test_a_training_step_offloaded_to_the_pool_matches_eager(pool: MemoryPool) -> None:
    torch.manual_seed(0)
    traced, flat, want = traced_step(MLP(), torch.randn(32, 48), torch.randint(0, 6, (32,)))
    pool.join("w1")
    pool.join("w2")
    blocks: dict[Any, int] = {}
    submitted = record_submissions(pool, blocks)
    cut_before = COSTS.bytes_so_far("cut")
    got, stats = await run_offloaded(pool, LivePlanning(cost_model=False), traced, flat, "s3")
    assert stats.gemms_offloaded == len(traced.gemm_nodes()) and stats.gemms_local == 0
    # Each GEMM's row and column blocks are cut and hashed once, whatever shares them.
    assert COSTS.bytes_so_far("cut") - cut_before == sum(blocks.values())
    assert_outputs_match(got, want)
    counters = pool.core.counters
    assert counters.tiles_verified > stats.gemms_offloaded  # several per GEMM
    # Small tiles go to a worker a refill's worth at a time: w2 may get none.
    credited = {c.name: c.tiles for c in pool.ledger.all()}
    assert set(credited) <= {"w1", "w2"} and sum(credited.values()) == counters.tiles_verified
    assert len(submitted) == counters.tiles_verified
    assert all(t.startswith("s3:") for t in submitted)  # the step is in the tile ids


async def test_the_cost_planner_shares_a_step_with_the_coordinator(pool: MemoryPool) -> None:
    """The default planner on a training step: grids from the cost model of two workers,
    the coordinator (as fast as each of them) keeping a share. Gradients match eager, and
    tiles kept here plus tiles verified are exactly the planned tiles."""
    torch.manual_seed(0)
    x, y = torch.randn(512, 256), torch.randint(0, 8, (512,))
    traced, flat, want = traced_step(WideMLP(), x, y)
    plans: list[tuple[int, int]] = []  # (tiles, kept here) of each GEMM sent as tiles

    class Recording(LivePlanning):
        def plan(self, *args: Any, **kwargs: Any) -> Any:
            choice = super().plan(*args, **kwargs)
            if choice.plan is not None and not choice.all_here:
                plans.append((len(choice.plan.tiles), len(choice.local)))
            return choice

    pool.join("w1")
    pool.join("w2")
    planning = Recording(coordinator_flops_per_s=PROFILE.gflops * 1e9)
    got, stats = await run_offloaded(pool, planning, traced, flat, "s4")
    assert_outputs_match(got, want)
    assert stats.gemms_offloaded == len(plans) > 0
    await asyncio.sleep(0)  # the last kept_here call the offload handed to the loop
    counters = pool.core.counters
    assert pool.core.tiles == {}
    assert counters.kept_here == sum(kept for _, kept in plans) > 0
    assert counters.tiles_verified == sum(t - kept for t, kept in plans) > 0
    assert pool.status()["tiles"]["kept_here"] == counters.kept_here
    assert pool.core.scheduler.pending() == 0


async def test_tiles_that_name_their_worker_go_to_it_or_are_stolen(pool: MemoryPool) -> None:
    """Earliest-finish placement, followed: every tile sent names the worker it was
    placed on (TileTicket.planned_for), the scheduler hands it to that worker or lets
    the other steal it, and the step still matches eager with nothing left behind."""
    torch.manual_seed(1)
    x, y = torch.randn(512, 256), torch.randint(0, 8, (512,))
    traced, flat, want = traced_step(WideMLP(), x, y)
    named: list[int] = []  # tiles that named a worker, per GEMM sent
    ids = {pool.join("one").worker_id, pool.join("two").worker_id}

    class Recording(LivePlanning):
        def plan(self, *args: Any, **kwargs: Any) -> Any:
            choice = super().plan(*args, **kwargs)
            if choice.plan is not None and not choice.all_here:
                assert set(choice.owners.values()) <= ids
                named.append(len(choice.owners))
            return choice

    got, stats = await run_offloaded(pool, Recording(rule="finish"), traced, flat, "s6")
    assert_outputs_match(got, want)
    assert stats.gemms_offloaded == len(named) > 0
    assert pool.core.counters.tiles_verified == sum(named) > 0
    assert pool.core.tiles == {}
    assert pool.core.scheduler.pending() == 0 and pool.core.scheduler.queued_count() == 0


async def test_the_offload_declines_what_it_cannot_tile(pool: MemoryPool) -> None:
    pool.join("w1")
    submitted = record_submissions(pool)
    offload = TileOffload(pool, asyncio.get_running_loop(), pool.key, lambda *_: PlanConfig())

    def never(value: object) -> None:
        raise AssertionError("declined GEMMs must not complete")

    ints = torch.ones(8, 8, dtype=torch.int64)
    small = torch.ones(8, 8)
    assert offload.start("ints", "mm", ints, ints, never) == 0
    assert offload.start("mixed", "mm", small, small.double(), never) == 0
    cplx = torch.ones(8, 8, dtype=torch.complex64)
    assert offload.start("complex", "mm", cplx, cplx, never) == 0
    # 1 kFLOP is far below PlanConfig().min_offload_flops: run it at the coordinator.
    assert offload.start("tiny", "mm", small, small, never) == 0
    await asyncio.sleep(0)
    assert submitted == [] and pool.core.tiles == {} and pool.core.counters.tiles_sent == 0


async def test_tiles_over_the_only_workers_memory_cap_are_computed_at_the_coordinator(
    pool: MemoryPool,
) -> None:
    pool.join("tiny", profile=replace(PROFILE, mem_cap_bytes=1))
    offload = TileOffload(
        pool,
        asyncio.get_running_loop(),
        pool.key,
        # What the coordinator's run passes (plan_config_for), with every GEMM offloaded.
        lambda workers, memory_cap: PlanConfig(
            min_offload_flops=1,
            target_tiles=max(2, 2 * workers),
            tile_mem_cap_bytes=min(
                memory_cap or PlanConfig.tile_mem_cap_bytes, PlanConfig.tile_mem_cap_bytes
            ),
        ),
        LivePlanning(cost_model=False),
    )
    products: list[Any] = []
    a, b = torch.randn(64, 48), torch.randn(48, 40)
    started = await asyncio.to_thread(offload.start, "mm", "mm", a, b, products.append)
    assert started == 2 * 64 * 48 * 40  # handed over whole (then computed here)
    await asyncio.sleep(0)  # the tiles reach the pool through the event loop
    assert pool.core.tiles and not products  # queued: too big for the only worker
    pool.tick()  # the server's expiry timer: stranded tiles are computed here
    [product] = products
    torch.testing.assert_close(product, a @ b)
    counters = pool.core.counters
    assert counters.computed_here >= 1
    assert counters.tiles_sent == 0  # nothing over its cap went to it
    assert pool.status()["tiles"]["computed_here"] == counters.computed_here
