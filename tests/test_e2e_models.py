"""Models as outsiders write them, trained by a real coordinator with two local workers
over loopback: fused attention at sequence 256, a CNN, data-dependent Python, and the
built-in job under bf16 autocast. Each trains 10 steps; per-step losses equal local torch
(1e-5 relative; bf16: see test_real_models.BF16_REL), and the share of each step's FLOPs
that workers computed is read from /api/status while the run goes on."""

from __future__ import annotations

import time
import urllib.error
from pathlib import Path
from typing import Any

import pytest
from procs import Coordinator, assert_losses_match
from real_models import make_cnn_job, make_data_dependent_job, make_sdpa_job
from test_real_models import BF16_REL

from coordinator.jobs.tiny_gpt import make_bf16_job
from coordinator.step.job import train_locally

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]
STEPS = 10


def _train(tmp_path: Path, job: str) -> tuple[Coordinator, dict[str, Any]]:
    """Serve ``job`` for STEPS steps as a user would (the cost planner, local workers);
    returns the coordinator and the last ``flops`` block /api/status showed."""
    coord = Coordinator(
        tmp_path, "--planner", "cost", "--job", job, "--steps", str(STEPS), "--local-workers", "2"
    )
    flops: dict[str, Any] = {}
    deadline = time.monotonic() + 300
    while coord.proc.poll() is None and time.monotonic() < deadline:
        try:
            flops = coord.status().get("flops") or flops
        except (OSError, urllib.error.URLError):
            pass  # the run ended between the check and the request
        time.sleep(0.2)
    assert coord.wait(60) == 0, coord.output()
    assert flops, "no step's FLOPs appeared in /api/status:\n" + coord.output()
    return coord, flops


def _losses(coord: Coordinator) -> list[float]:
    records = coord.steps()
    assert len(records) == STEPS and all(r["tiles"] > 0 for r in records), records
    return [r["loss"] for r in records]


def test_transformer_with_fused_attention_at_sequence_256(tmp_path: Path) -> None:
    coord, flops = _train(tmp_path, "real_models:make_sdpa_job")
    assert_losses_match(_losses(coord), train_locally(make_sdpa_job(), STEPS))
    assert flops["workers_share"] >= 0.95, flops
    assert "workers computed" in coord.output()


def test_cnn_with_batch_norm_pooling_and_a_residual(tmp_path: Path) -> None:
    coord, flops = _train(tmp_path, "real_models:make_cnn_job")
    assert_losses_match(_losses(coord), train_locally(make_cnn_job(), STEPS))
    assert flops["workers_share"] >= 0.90, flops


def test_model_with_data_dependent_python_runs_eagerly_and_says_why(tmp_path: Path) -> None:
    coord, flops = _train(tmp_path, "real_models:make_data_dependent_job")
    assert_losses_match(_losses(coord), train_locally(make_data_dependent_job(), STEPS))
    assert flops["workers_share"] >= 0.90, flops
    out = coord.output()
    assert "cannot be captured as one graph" in out and ".item()" in out
    assert all(not r["captured"] for r in coord.steps())


def test_builtin_job_under_bf16_autocast(tmp_path: Path) -> None:
    coord, flops = _train(tmp_path, "coordinator.jobs.tiny_gpt:make_bf16_job")
    assert_losses_match(_losses(coord), train_locally(make_bf16_job(), STEPS), rel=BF16_REL)
    assert flops["workers_share"] >= 0.90, flops
    assert "bf16/fp16 tiles:" in coord.output() and "MB saved" in coord.output()
