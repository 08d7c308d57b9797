"""The coordinator's threads orchestrate on one torch thread and compute on all."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from coordinator.plan.planner import GemmShape, PlanConfig, plan_gemm
from coordinator.step.torch_threads import (
    COMPUTE_THREADS,
    computing,
    orchestrate_on_one_thread,
)
from coordinator.tiles import tiled_gemm


def _in_a_thread() -> list[int]:
    seen: list[int] = []

    def run() -> None:
        orchestrate_on_one_thread()
        seen.append(torch.get_num_threads())
        with computing():
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return seen


def test_a_thread_orchestrates_on_one_and_computes_on_the_default_team() -> None:
    default = torch.get_num_threads()
    assert _in_a_thread() == [1, COMPUTE_THREADS, 1]
    assert torch.get_num_threads() == default  # the setting is the calling thread's own


def test_the_tiles_kept_at_the_coordinator_are_multiplied_on_the_default_team(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []
    real = tiled_gemm.computing

    @contextmanager
    def recording() -> Iterator[None]:
        with real():
            seen.append(torch.get_num_threads())
            yield

    monkeypatch.setattr(tiled_gemm, "computing", recording)
    a, b = torch.randn(64, 48), torch.randn(48, 80)
    plan = plan_gemm(
        GemmShape("mm", 1, 64, 80, 48, 4),
        PlanConfig(min_offload_flops=1, min_tile_flops=1, min_tile_side=16, target_tiles=4),
    )
    assert plan is not None and len(plan.tiles) > 1
    out: list[torch.Tensor] = []
    gemm = tiled_gemm.TiledGemm("g", plan, a, b, out.append, local=[r.index for r in plan.tiles])

    def run() -> None:
        orchestrate_on_one_thread()
        gemm.compute_local()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert seen == [COMPUTE_THREADS] * len(plan.tiles)
    torch.testing.assert_close(out[0], a @ b)
