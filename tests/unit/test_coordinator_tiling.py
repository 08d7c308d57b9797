"""TiledGemm: a planned GEMM cut into signed tile bundles and put back together.

Tiles are delivered in random order, with duplicates, from one or many threads; the
assembled output must equal ``torch.matmul`` (rtol 1e-5), ``on_done`` must fire exactly
once, and every bundle must parse and verify against the coordinator's key, carrying
exactly the operand slices of its region.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.errors import SignatureError
from common.messages import Task, parse_message, verify_task
from common.signing import generate_private_key
from common.tensors import content_id
from coordinator.plan.planner import GemmShape, PlanConfig, plan_gemm
from coordinator.tiles.tiled_gemm import SignedTile, TiledGemm

KEY = generate_private_key()
SMALL = dict(min_offload_flops=1, min_tile_flops=1)

# (op, batch, m, n, k, dtype, plan config, expected grid or None, expect a K split)
CASES = [
    ("mm", 1, 33, 65, 17, torch.float32, PlanConfig(**SMALL, target_tiles=6), (1, 2, 3, 1)),
    ("mm", 1, 40, 24, 31, torch.float32, PlanConfig(**SMALL, target_tiles=1), (1, 1, 1, 1)),
    (
        "mm",
        1,
        64,
        48,
        512,
        torch.float32,
        PlanConfig(**SMALL, tile_mem_cap_bytes=40_000),
        (1, 2, 1, 8),
    ),
    (
        "mm",
        1,
        100,
        100,
        1000,
        torch.float64,
        PlanConfig(**SMALL, tile_mem_cap_bytes=40_000, min_tile_side=16),
        None,
    ),
    ("bmm", 5, 16, 16, 16, torch.float32, PlanConfig(**SMALL, target_tiles=8), (5, 2, 1, 1)),
    (
        "bmm",
        3,
        40,
        24,
        300,
        torch.float32,
        PlanConfig(**SMALL, tile_mem_cap_bytes=30_000),
        (3, 1, 1, 3),
    ),
    (
        "bmm",
        2,
        37,
        29,
        257,
        torch.float32,
        PlanConfig(**SMALL, tile_mem_cap_bytes=12_000, min_tile_side=8),
        None,
    ),
]
IDS = [
    f"{c[0]}-{c[1]}x{c[2]}x{c[3]}x{c[4]}-{str(c[5])[6:]}-{c[6].tile_mem_cap_bytes}" for c in CASES
]


def operands(
    op: str, batch: int, m: int, n: int, k: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lead = (batch,) if op == "bmm" else ()
    return (
        torch.randn(*lead, m, k, generator=g).to(dtype),
        torch.randn(*lead, k, n, generator=g).to(dtype),
    )


class Done:
    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []
        self.lock = threading.Lock()

    def __call__(self, out: torch.Tensor) -> None:
        with self.lock:
            self.calls.append(out)


def tiled(case: tuple, seed: int = 0) -> tuple[TiledGemm, list[SignedTile], Done, torch.Tensor]:
    op, batch, m, n, k, dtype, config, grid = case
    a, b = operands(op, batch, m, n, k, dtype, seed)
    want = torch.matmul(a, b)
    plan = plan_gemm(GemmShape(op, batch, m, n, k, a.element_size()), config)
    assert plan is not None
    if grid is not None:
        assert plan.grid == grid
    done = Done()
    gemm = TiledGemm(f"g{seed}", plan, a, b, done)
    return gemm, list(gemm.iter_tiles(KEY)), done, want


def product(job: SignedTile) -> torch.Tensor:
    return torch.matmul(job.a, job.b)


def assert_matches(out: torch.Tensor, want: torch.Tensor) -> None:
    # rtol 1e-5; near-zero outputs (cancellation) get 1e-6 of the output's range.
    atol = 1e-6 * float(want.abs().max())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=atol)


def test_cases_cover_k_splits_of_mm_and_bmm() -> None:
    split = {(c[0], tiled(c)[0].plan.k_split) for c in CASES}
    assert {("mm", True), ("mm", False), ("bmm", True), ("bmm", False)} <= split


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_tiles_in_random_order_with_duplicates_assemble_the_product(case: tuple) -> None:
    gemm, jobs, done, want = tiled(case, seed=1)
    rng = random.Random(7)
    order = jobs + rng.sample(jobs, max(1, len(jobs) // 2))  # every tile, some twice
    rng.shuffle(order)
    seen: set[str] = set()
    completions = 0
    for job in order:
        first = job.tile_id not in seen
        seen.add(job.tile_id)
        finished = gemm.deliver(job.region, product(job))
        completions += finished
        assert not (finished and not first), "a duplicate delivery completed the GEMM"
        assert len(done.calls) == completions
    # Duplicates after completion change nothing either.
    for job in rng.sample(jobs, min(3, len(jobs))):
        assert gemm.deliver(job.region, torch.full_like(product(job), 1e6)) is False
    assert completions == 1 and len(done.calls) == 1
    out = done.calls[0]
    assert out is gemm.out and out.dtype == want.dtype and out.shape == want.shape
    assert_matches(out, want)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bundles_parse_verify_and_carry_their_regions_operands(case: tuple) -> None:
    op, batch, m, n, k, dtype, *_ = case
    a, b = operands(op, batch, m, n, k, dtype, seed=2)
    gemm, jobs, _, _ = tiled(case, seed=2)
    assert len(jobs) == len(gemm.plan.tiles)
    assert len({job.tile_id for job in jobs}) == len(jobs)
    itemsize = a.element_size()
    for job, region in zip(jobs, gemm.plan.tiles, strict=True):
        assert job.region == region and job.gemm is gemm
        received = parse_message(job.bundle.join())
        task = received.message
        assert isinstance(task, Task)
        assert (task.tile_id, task.op) == (job.tile_id, op)
        got_a, got_b = verify_task(received, KEY.public_key())
        if op == "bmm":
            want_a = a[region.b0 : region.b1, region.m0 : region.m1, region.k0 : region.k1]
            want_b = b[region.b0 : region.b1, region.k0 : region.k1, region.n0 : region.n1]
        else:
            want_a = a[region.m0 : region.m1, region.k0 : region.k1]
            want_b = b[region.k0 : region.k1, region.n0 : region.n1]
        for got, held, want in ((got_a, job.a, want_a), (got_b, job.b, want_b)):
            assert got.dtype == dtype and torch.equal(got, want) and torch.equal(held, want)
            assert held.is_contiguous()
        ticket = job.ticket
        assert (ticket.tile_id, ticket.gemm_id) == (job.tile_id, gemm.gemm_id)
        assert ticket.flops == job.flops == region.flops
        assert ticket.down_bytes == region.down_bytes(itemsize)
        assert ticket.up_bytes == region.up_bytes(itemsize)
    assert sum(job.flops for job in jobs) == gemm.plan.shape.flops


def test_a_bundle_does_not_verify_under_another_key() -> None:
    _, jobs, _, _ = tiled(CASES[0])
    with pytest.raises(SignatureError):
        verify_task(parse_message(jobs[0].bundle.join()), generate_private_key().public_key())


@pytest.mark.parametrize("case", [c for c in CASES if c[6].tile_mem_cap_bytes < 1 << 20], ids=str)
def test_k_split_sum_does_not_depend_on_arrival_order(case: tuple) -> None:
    outputs = []
    for seed in (0, 1, 2):
        gemm, jobs, done, _ = tiled(case, seed=3)
        assert gemm.plan.k_split
        order = list(jobs)
        random.Random(seed).shuffle(order)
        if seed == 2:
            order.reverse()
        for job in order:
            gemm.deliver(job.region, product(job))
        outputs.append(done.calls[0])
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_split_partials_add_up_in_k_order_and_stay_as_they_came(dtype: torch.dtype) -> None:
    # A partial is a view of the bytes its result came in: the sum goes elsewhere.
    gemm, jobs, done, _ = tiled((*CASES[2][:5], dtype, CASES[2][6], None), seed=4)
    assert gemm.plan.k_split
    partials = {job.region.index: product(job) for job in jobs}
    kept = {index: p.clone() for index, p in partials.items()}
    for job in reversed(jobs):
        gemm.deliver(job.region, partials[job.region.index])
    for index, partial in partials.items():
        assert torch.equal(partial, kept[index])
    (out,) = done.calls
    for job in jobs:
        bi, mi, ni, ki = job.region.index
        if ki:
            continue
        # fp32 sums of the partials in K order, rounded once to the tile's dtype.
        total = kept[job.region.index].float()
        for k in range(1, gemm.plan.grid[3]):
            total += kept[(bi, mi, ni, k)]
        r = job.region
        assert torch.equal(out[r.m0 : r.m1, r.n0 : r.n1], total.to(dtype))


@pytest.mark.parametrize("case", [CASES[3], CASES[6]], ids=[IDS[3], IDS[6]])
def test_concurrent_deliveries_from_many_threads_complete_once(case: tuple) -> None:
    gemm, jobs, done, want = tiled(case, seed=4)
    products = {job.tile_id: product(job) for job in jobs}
    order = jobs * 3  # every tile three times
    random.Random(4).shuffle(order)
    with ThreadPoolExecutor(4) as pool:
        finished = list(
            pool.map(lambda job: gemm.deliver(job.region, products[job.tile_id]), order)
        )
    assert sum(finished) == 1 and len(done.calls) == 1
    assert_matches(done.calls[0], want)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[7]}")
def test_tiles_kept_at_the_coordinator_are_not_sent_and_complete_the_product(case: tuple) -> None:
    op, batch, m, n, k, dtype, config, _grid = case
    a, b = operands(op, batch, m, n, k, dtype, 3)
    plan = plan_gemm(GemmShape(op, batch, m, n, k, a.element_size()), config)
    assert plan is not None
    local = {t.index for t in plan.tiles[::2]}  # every other tile (K partials included)
    done = Done()
    gemm = TiledGemm("g", plan, a, b, done, local=local)
    jobs = list(gemm.iter_tiles(KEY))
    assert {j.region.index for j in jobs} == {t.index for t in plan.tiles} - local
    random.Random(0).shuffle(jobs)
    half = len(jobs) // 2
    for job in jobs[:half]:  # some of the workers' tiles arrive first ...
        assert not gemm.deliver(job.region, product(job))
    # ... then the coordinator computes its share, then the rest arrive.
    assert gemm.compute_local() is (len(jobs) == 0)
    finished = [gemm.deliver(job.region, product(job)) for job in jobs[half:]]
    assert finished == [False] * (len(finished) - 1) + [True] * bool(finished)
    assert len(done.calls) == 1
    assert_matches(done.calls[0], torch.matmul(a, b))


def test_the_coordinators_share_can_finish_the_gemm() -> None:
    a, b = operands("mm", 1, 40, 20, 30, torch.float32, 4)
    plan = plan_gemm(GemmShape("mm", 1, 40, 20, 30, 4), PlanConfig(**SMALL, target_tiles=4))
    assert plan is not None and len(plan.tiles) == 6
    done = Done()
    owners = {t.index: f"w{i % 2}" for i, t in enumerate(plan.tiles[:-1])}
    gemm = TiledGemm("g", plan, a, b, done, local={plan.tiles[-1].index}, owners=owners)
    jobs = list(gemm.iter_tiles(KEY))
    assert len(jobs) == 5
    # Each ticket names the worker the planner placed its tile on.
    assert {j.region.index: j.ticket.planned_for for j in jobs} == owners
    for job in jobs:
        assert not gemm.deliver(job.region, product(job))
    assert gemm.compute_local() and len(done.calls) == 1
    assert_matches(done.calls[0], a @ b)


def test_operand_blocks_are_keyed_by_content() -> None:
    x, w, g = torch.randn(64, 32), torch.randn(32, 48), torch.randn(64, 48)
    config = PlanConfig(**SMALL, target_tiles=4)
    plan = plan_gemm(GemmShape("mm", 1, 64, 48, 32, 4), config)
    assert plan is not None
    # Two GEMMs that read the same A (an activation feeding two layers) and different Bs.
    fwd = TiledGemm("fwd", plan, x, w, Done())
    other = TiledGemm("other", plan, x, w * 2, Done())
    fwd_jobs, other_jobs = list(fwd.iter_tiles(KEY)), list(other.iter_tiles(KEY))
    assert fwd.plan.grid == (1, 2, 2, 1)
    assert [j.blocks[0] for j in fwd_jobs] == [j.blocks[0] for j in other_jobs]
    assert not {j.blocks[1] for j in fwd_jobs} & {j.blocks[1] for j in other_jobs}
    # Within a GEMM, tiles of one row share the A block, tiles of one column the B block.
    a_ids = [j.blocks[0] for j in fwd_jobs]
    b_ids = [j.blocks[1] for j in fwd_jobs]
    assert a_ids[0] == a_ids[1] != a_ids[2] == a_ids[3]
    assert b_ids[0] == b_ids[2] != b_ids[1] == b_ids[3]
    # The id is of dtype, shape and bytes, not of where the block sits.
    assert content_id(x[:32]) == content_id(x[:32].clone()) == a_ids[0]
    assert content_id(x[:32]) != content_id(x[:32].reshape(16, 64))
    assert content_id(x[:32]) != content_id(x[:32].double())
    assert content_id(g[:, 24:]) == content_id(g[:, 24:].contiguous())  # strided views hash alike


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_tiles_check_partners_are_the_rest_of_its_row_still_out(case: tuple) -> None:
    gemm, jobs, _, _ = tiled(case, seed=9)
    by_index = {job.region.index: job for job in jobs}

    def row_of(job: SignedTile) -> list[SignedTile]:
        bi, mi, ni, ki = job.region.index
        return [o for (b, m, n, k), o in by_index.items() if (b, m, k) == (bi, mi, ki) and n != ni]

    for job in jobs:
        partners = job.check_partners()
        others = row_of(job)
        assert [key for key, _ in partners] == [o.check_blocks[1] for o in others]
        for (_, operand), other in zip(partners, others, strict=True):
            assert operand is other.b  # the block as sent and checked, not a copy
    # A placed tile is no one's partner any more; nor, once all are in, is anything left.
    placed = jobs[0]
    gemm.deliver(placed.region, product(placed))
    for job in row_of(placed):
        assert placed.check_blocks[1] not in [key for key, _ in job.check_partners()]
    for job in jobs[1:]:
        gemm.deliver(job.region, product(job))
    assert all(job.check_partners() == [] for job in jobs)


def test_blocks_already_in_row_order_go_out_from_the_operands_own_memory() -> None:
    """A row block of A and a column block of a transposed weight lie in order in their
    matrices: they are sent and checked where they lie. A column block of a B in row
    order does not, and is copied once."""
    plan = plan_gemm(GemmShape("mm", 1, 33, 65, 17, 4), PlanConfig(**SMALL, target_tiles=6))
    assert plan is not None and plan.grid == (1, 2, 3, 1)
    a, b = operands("mm", 1, 33, 65, 17, torch.float32, 5)
    weight = b.mT.contiguous()  # [n, k], as nn.Linear keeps it: the B operand is weight.mT
    for operand_b, b_shared in ((b, False), (weight.mT, True)):
        gemm = TiledGemm("g", plan, a, operand_b, Done())
        jobs = list(gemm.iter_tiles(KEY))
        for job in jobs:
            assert job.a.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
            same = job.b.untyped_storage().data_ptr() == operand_b.untyped_storage().data_ptr()
            assert same is b_shared
            r = job.region
            assert_matches(job.a @ job.b, (a @ operand_b)[r.m0 : r.m1, r.n0 : r.n1])
