"""Where the server checks returned tiles: small ones on the event loop, the rest on
the check thread, with the same verdicts either way."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from common.messages import Result, encode_message, parse_message
from common.signing import generate_private_key
from coordinator.plan.planner import GemmShape, PlanConfig, plan_gemm
from coordinator.pool.effects import Check
from coordinator.serve import checks as checks_module
from coordinator.serve.checks import ON_LOOP_MAX_MACS, CheckThread
from coordinator.step.cpu_costs import COSTS
from coordinator.tiles.tiled_gemm import SignedTile, TiledGemm
from coordinator.tiles.verify import CheckReason

KEY = generate_private_key()


def one_tile(side: int) -> SignedTile:
    """A side^3 GEMM planned as one tile."""
    gen = torch.Generator().manual_seed(side)
    a, b = torch.randn(side, side, generator=gen), torch.randn(side, side, generator=gen)
    plan = plan_gemm(
        GemmShape("mm", 1, side, side, side, 4), PlanConfig(min_offload_flops=1, target_tiles=1)
    )
    assert plan is not None and len(plan.tiles) == 1
    (job,) = TiledGemm(f"g{side}", plan, a, b, lambda out: None).iter_tiles(KEY)
    return job


def check_of(job: SignedTile, c: torch.Tensor) -> Check:
    frame = encode_message(Result(job.tile_id, compute_s=0.01), [("c", c)])
    return Check("w1", job.tile_id, job, parse_message(frame), len(frame), 0.01)


def count_check_products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of tiles of each ``check_products`` call from now on."""
    calls: list[int] = []
    real = checks_module.check_products

    def counting(tiles: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(tiles))
        return real(tiles, *args, **kwargs)

    monkeypatch.setattr(checks_module, "check_products", counting)
    return calls


def placed_on(job: SignedTile) -> list[int]:
    """The threads that place the tile into its GEMM, as it happens."""
    threads: list[int] = []
    deliver = job.gemm.deliver

    def recording(*args: Any, **kwargs: Any) -> bool:
        threads.append(threading.get_ident())
        return deliver(*args, **kwargs)

    job.gemm.deliver = recording  # type: ignore[method-assign]
    return threads


@pytest.mark.parametrize("side", [64, 128, 160])
def test_small_tiles_are_checked_on_the_loop_and_large_ones_on_the_thread(side: int) -> None:
    good, bad = one_tile(side), one_tile(side)
    threads = placed_on(good)
    a, b = good.matrices()
    c = a @ b
    wrong = c.clone()
    wrong[3, 5] += 1.0

    async def main() -> tuple[Any, Any]:
        checks = CheckThread()
        try:
            return await checks.run(check_of(good, c)), await checks.run(check_of(bad, wrong))
        finally:
            checks.shutdown()

    before = COSTS.snapshot().get("check_on_loop", 0.0)
    passed, failed = asyncio.run(main())
    on_loop = side**3 <= ON_LOOP_MAX_MACS
    assert passed.result.ok and passed.finished
    assert not failed.result.ok and failed.result.reason is CheckReason.MISMATCH
    assert (threads == [threading.get_ident()]) is on_loop  # asyncio.run's loop is ours
    assert (COSTS.snapshot().get("check_on_loop", 0.0) > before) is on_loop


def test_the_check_thread_multiplies_with_one_torch_thread() -> None:
    # Its own setting: the rest of the process keeps torch's default team.
    async def main() -> int:
        checks = CheckThread()
        try:
            return await checks._run(torch.get_num_threads)
        finally:
            checks.shutdown()

    default = torch.get_num_threads()
    assert asyncio.run(main()) == 1
    assert torch.get_num_threads() == default


def test_small_checks_on_the_loop_use_one_torch_thread_and_leave_the_loops_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The loop may be its host's main thread: the setting is borrowed, not kept.
    seen: list[int] = []
    real = checks_module.check_products

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(checks_module, "check_products", recording)
    job = one_tile(64)
    a, b = job.matrices()

    async def main() -> tuple[Any, int]:
        checks = CheckThread()
        try:
            return await checks.run(check_of(job, a @ b)), torch.get_num_threads()
        finally:
            checks.shutdown()

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outcome, after = asyncio.run(main())
    finally:
        torch.set_num_threads(before)
    assert outcome.result.ok
    assert seen == [1]
    assert after == 2


def test_small_results_of_one_turn_are_checked_together(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_check_products(monkeypatch)
    monkeypatch.setattr(checks_module, "ON_LOOP_MAX_STACK", 4)
    jobs = [one_tile(32 + i) for i in range(6)]  # one shape each: check_product alone
    jobs += [one_tile(64) for _ in range(5)]  # one stack
    results = []
    for i, job in enumerate(jobs):
        a, b = job.matrices()
        c = a @ b
        if i % 3 == 0:
            c[0, 0] += 1.0
        results.append(check_of(job, c))

    async def main() -> list[Any]:
        checks = CheckThread()
        try:
            return await asyncio.gather(*(checks.run(result) for result in results))
        finally:
            checks.shutdown()

    outcomes = asyncio.run(main())
    assert [o.result.ok for o in outcomes] == [i % 3 != 0 for i in range(len(jobs))]
    assert calls == [4, 4, 3]  # one turn's results, a stack's worth at a time


def test_large_results_that_queue_while_the_thread_is_busy_are_checked_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = count_check_products(monkeypatch)
    monkeypatch.setattr(checks_module, "ON_THREAD_MAX_BATCH", 3)
    jobs = [one_tile(192) for _ in range(4)]
    results = []
    for i, job in enumerate(jobs):
        a, b = job.matrices()
        c = a @ b
        if i == 2:
            c[1, 1] += 1.0
        results.append(check_of(job, c))
    busy, release = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        assert release.wait(30)

    async def main() -> list[Any]:
        checks = CheckThread()
        try:
            held = asyncio.ensure_future(checks._run(hold))
            assert await asyncio.to_thread(busy.wait, 30)
            first = asyncio.ensure_future(checks.run(results[0]))  # the thread's next batch
            await asyncio.sleep(0)
            rest = [asyncio.ensure_future(checks.run(r)) for r in results[1:]]
            await asyncio.sleep(0)
            release.set()
            await held
            return await asyncio.wait_for(asyncio.gather(first, *rest), 30)
        finally:
            checks.shutdown()

    outcomes = asyncio.run(main())
    assert [o.result.ok for o in outcomes] == [True, True, False, True]
    assert calls == [3, 1]  # all four queued behind the held job: a batch's worth at a time


@pytest.mark.parametrize("side", [64, 192])  # on the loop, on the thread
def test_a_failing_stack_fails_each_waiter_instead_of_leaving_it_waiting(
    monkeypatch: pytest.MonkeyPatch, side: int
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(checks_module, "check_products", broken)
    job = one_tile(side)
    a, b = job.matrices()

    async def main() -> list[Any]:
        checks = CheckThread()
        try:
            runs = (checks.run(check_of(job, a @ b)) for _ in range(2))
            return await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 10)
        finally:
            checks.shutdown()

    assert [type(e) for e in asyncio.run(main())] == [RuntimeError, RuntimeError]


@pytest.mark.parametrize("side", [64, 160])  # on the loop, on the thread
def test_a_callback_that_raises_does_not_keep_the_others_of_its_batch_waiting(
    side: int, caplog: pytest.LogCaptureFixture
) -> None:
    jobs = [one_tile(side) for _ in range(3)]
    got: list[tuple[str, bool]] = []

    async def main() -> None:
        all_in = asyncio.Event()

        def done(check: Check, outcome: Any) -> None:
            got.append((check.tile_id, outcome.result.ok))
            if len(got) == len(jobs):
                all_in.set()
            if len(got) == 1:
                raise RuntimeError("a bug in the first verdict's handling")

        checks = CheckThread()
        try:
            for job in jobs:
                a, b = job.matrices()
                checks.submit(check_of(job, a @ b), done)
            await asyncio.wait_for(all_in.wait(), 30)
        finally:
            checks.shutdown()

    asyncio.run(main())
    assert got == [(job.tile_id, True) for job in jobs]
    assert "a bug in the first verdict's handling" in caplog.text


@pytest.mark.parametrize("side", [64, 160])  # on the loop, and on the thread
def test_a_result_for_a_tile_placed_already_is_not_checked(
    side: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another copy's result is in: the step may have gone on and changed this tile's
    operands (a weight after the optimizer's step), so a check now could fail an honest
    result. It is neither checked nor held against its worker."""
    job = one_tile(side)
    a, b = job.matrices()
    honest, wrong = a @ b, torch.zeros(side, side)
    assert job.gemm.deliver(job.region, honest)  # the first copy's result
    a.add_(1.0)  # the operands move on
    calls = count_check_products(monkeypatch)

    async def main() -> list[Any]:
        checks = CheckThread()
        try:
            return [await checks.run(check_of(job, c)) for c in (honest, wrong)]
        finally:
            checks.shutdown()

    for outcome in asyncio.run(main()):
        assert outcome.late and outcome.result is None and not outcome.finished
    assert sum(calls) == 0
