"""Which GEMMs the coordinator keeps for being cheaper here than as tiles
(coordinator/plan/keep_home.py), and the offload and ``serve`` option that use it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from common.signing import generate_private_key
from coordinator.plan.estimates import DeviceEstimate
from coordinator.plan.keep_home import KeepHome, intensity
from coordinator.plan.live import LivePlanning
from coordinator.plan.planner import GemmShape, PlanConfig
from coordinator.pool.workers import PoolView
from coordinator.serve.offload import TileOffload
from coordinator.serve_options import offload_intensity

# A 12 x 768 GPT's step at 8 x 128 tokens, per layer: attention's products (16 FLOP per
# byte moved) and the linear layers' (140 and more).
SCORES = GemmShape("bmm", 96, 128, 128, 64, 4)
LINEAR = GemmShape("mm", 1, 1024, 768, 768, 4)
FC = GemmShape("mm", 1, 1024, 3072, 768, 4)


def GFLOPS_90() -> float:  # noqa: N802 - a speed, as the offload measures it
    return 90e9  # this machine's speed here: break-even 117 FLOP per byte


def GFLOPS_9() -> float:  # noqa: N802
    return 9e9


def unasked() -> float:
    raise AssertionError("a fixed intensity needs no speed")


def test_intensity_is_flops_per_byte_moved() -> None:
    assert intensity(SCORES) == pytest.approx(16.0, abs=0.05)
    assert intensity(LINEAR) == pytest.approx(139.6, abs=0.05)


def test_only_gemms_below_break_even_stay_and_the_rest_go() -> None:
    keep = KeepHome()
    layer = [LINEAR, SCORES, SCORES, LINEAR, FC, FC]
    # A GEMM is judged against the FLOPs seen so far: in the first steps, a part of a
    # step weighs as much as the whole steps before it.
    first = [keep.keeps(shape, GFLOPS_90) for shape in layer]
    assert first == [False, False, False, False, False, False]  # 0.4 of 1.6 GFLOP seen
    keep.keeps(LINEAR, GFLOPS_90)
    keep.keeps(SCORES, GFLOPS_90)
    assert not keep.keeps(SCORES, GFLOPS_90)  # step 2: 0.8 of 14.0 GFLOP is over 5%
    for shape in layer[3:]:
        keep.keeps(shape, GFLOPS_90)
    for _ in range(3):  # steps
        kept = [keep.keeps(shape, GFLOPS_90) for shape in layer]
        assert kept == [False, True, True, False, False, False]
    # A coordinator five times slower breaks even below attention's intensity: it keeps
    # nothing (a CPU without bf16 units, for a bf16 GEMM).
    assert not any(KeepHome().keeps(shape, GFLOPS_9) for shape in layer)


def test_what_stays_is_bounded_by_its_share_of_the_flops_least_intense_first() -> None:
    # A small model whose every GEMM is below break-even: workers still get 95%.
    small = [GemmShape("mm", 1, 256, 128, 128, 4), GemmShape("bmm", 8, 64, 64, 32, 4)]
    small += [GemmShape("mm", 1, 256, 512, 128, 4)] * 4
    assert all(intensity(s) < 117 for s in small)
    keep = KeepHome(share=0.05)
    for _ in range(3):
        kept = [keep.keeps(shape, GFLOPS_90) for shape in small]
    total = sum(s.flops for s in small)
    kept_flops = sum(s.flops for s, k in zip(small, kept, strict=True) if k)
    assert kept == [False, True, False, False, False, False]  # the bmm: least intense
    assert 0 < kept_flops <= 0.05 * total
    assert not any(KeepHome(share=0.0).keeps(shape, GFLOPS_90) for shape in small)
    assert not KeepHome(share=1.0).keeps(GemmShape("mm", 1, 0, 0, 0, 4), GFLOPS_90)
    with pytest.raises(ValueError):
        KeepHome(share=1.5)


class _Server:
    def __init__(self) -> None:
        estimates = (DeviceEstimate("w1", 10e9, 1e9, 1e9, 1 << 28),)
        self.pool = PoolView(workers=1, active=1, memory_cap=1 << 28, estimates=estimates)
        self.submitted: list[Any] = []

    def submit(self, jobs: list[Any]) -> None:
        self.submitted.extend(jobs)

    def kept_here(self, gemm_id: str, tiles: int, finished: bool) -> None:
        pass


# Break-even far above both GEMMs whatever this machine's speed; half the FLOPs may stay.
@pytest.mark.parametrize("keep_home", [None, KeepHome(cpu_s_per_byte=1e-7, share=0.5)])
def test_the_offload_runs_low_intensity_gemms_here_with_keep_home(
    keep_home: KeepHome | None,
) -> None:
    loop = asyncio.new_event_loop()
    try:
        server = _Server()
        config = PlanConfig(min_offload_flops=1, min_tile_flops=1, target_tiles=2)
        offload = TileOffload(
            server, loop, generate_private_key(), lambda *_: config, LivePlanning(), keep_home
        )
        heads_a, heads_b = torch.randn(96, 128, 64), torch.randn(96, 64, 128)
        linear_a, linear_b = torch.randn(1024, 768), torch.randn(768, 768)
        rng = torch.get_rng_state()
        assert offload.start("s0:mm", "mm", linear_a, linear_b, lambda _: None) > 0
        sent = offload.start("s0:bmm", "bmm", heads_a, heads_b, lambda _: None)
        assert (sent == 0) == (keep_home is not None)
        # Measuring its speed drew nothing from the training's random stream.
        assert torch.equal(torch.get_rng_state(), rng)
    finally:
        loop.close()


def test_a_fixed_intensity_keeps_every_gemm_under_it_whatever_its_share() -> None:
    # --min-offload-intensity 60: the scores stay, all of them; the linear layer goes.
    keep = KeepHome(below=60.0)
    for _ in range(3):
        assert [keep.keeps(s, unasked) for s in (SCORES, SCORES, LINEAR)] == [True, True, False]
    assert not any(KeepHome(below=0.0).keeps(s, unasked) for s in (SCORES, LINEAR))
    with pytest.raises(ValueError, match="below"):
        KeepHome(below=-1.0)


@pytest.mark.parametrize(("value", "want"), [("auto", None), ("0", 0.0), ("60", 60.0)])
def test_min_offload_intensity_values(value: str, want: float | None) -> None:
    assert offload_intensity(value) == want


@pytest.mark.parametrize("value", ["fast", "-1", "inf", "nan"])
def test_bad_min_offload_intensity_is_refused(value: str) -> None:
    with pytest.raises(SystemExit, match="min-offload-intensity"):
        offload_intensity(value)
