"""Models as outsiders write them, trained by a real coordinator with two local workers
over loopback: fused attention at sequence 256, a CNN, data-dependent Python, the
built-in job under bf16 autocast, mixture-of-experts models (grouped GEMMs and an expert
loop), grouped convolutions (ResNeXt), depthwise ones (ConvNeXt), and a tied embedding
whose gradients underflow fp32's squares. Each trains 10
steps; per-step losses equal local torch (1e-5 relative; bf16: see
test_real_models.BF16_REL), and the share of each step's FLOPs that workers computed is
read from /api/status while the run goes on."""

from __future__ import annotations

import time
import urllib.error
from pathlib import Path
from typing import Any

import pytest
from support.procs import Coordinator, assert_losses_match
from support.real_models import (
    make_cnn_job,
    make_convnext_job,
    make_data_dependent_job,
    make_moe_job,
    make_moe_loop_job,
    make_resnext_job,
    make_sdpa_job,
    make_tied_lm_job,
)
from support.recording_offload import BF16_REL

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
    coord, flops = _train(tmp_path, "support.real_models:make_sdpa_job")
    assert_losses_match(_losses(coord), train_locally(make_sdpa_job(), STEPS))
    assert flops["workers_share"] >= 0.95, flops
    assert "workers computed" in coord.output()


def test_cnn_with_batch_norm_pooling_and_a_residual(tmp_path: Path) -> None:
    coord, flops = _train(tmp_path, "support.real_models:make_cnn_job")
    assert_losses_match(_losses(coord), train_locally(make_cnn_job(), STEPS))
    assert flops["workers_share"] >= 0.90, flops


def test_model_with_data_dependent_python_runs_eagerly_and_says_why(tmp_path: Path) -> None:
    coord, flops = _train(tmp_path, "support.real_models:make_data_dependent_job")
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


def test_mixture_of_experts_with_grouped_gemms(tmp_path: Path) -> None:
    coord, flops = _train(tmp_path, "support.real_models:make_moe_job")
    assert_losses_match(_losses(coord), train_locally(make_moe_job(), STEPS))
    assert flops["workers_share"] >= 0.95 and flops["uncounted"] == [], flops
    assert all(r["captured"] for r in coord.steps())


def test_mixture_of_experts_as_a_python_loop(tmp_path: Path) -> None:
    coord, flops = _train(tmp_path, "support.real_models:make_moe_loop_job")
    assert_losses_match(_losses(coord), train_locally(make_moe_loop_job(), STEPS))
    assert flops["workers_share"] >= 0.95, flops
    assert "torch.where(cond)" in coord.output()


def test_grouped_convolutions(tmp_path: Path) -> None:
    coord, flops = _train(tmp_path, "support.real_models:make_resnext_job")
    assert_losses_match(_losses(coord), train_locally(make_resnext_job(), STEPS))
    assert flops["workers_share"] >= 0.95, flops


def test_depthwise_convolutions_stay_here_and_the_share_says_so(tmp_path: Path) -> None:
    coord, flops = _train(tmp_path, "support.real_models:make_convnext_job")
    assert_losses_match(_losses(coord), train_locally(make_convnext_job(), STEPS))
    assert flops["workers_share"] >= 0.90, flops
    kept = {k["op"]: k["why"] for k in flops["kept_here"]}
    assert "no check cheaper than computing it" in kept["depthwise convolution"], flops
    assert "convolution" not in kept and "convolution_backward" not in kept, flops
    summary = coord.output().split("FLOPs of the last step:")[-1]
    assert "depthwise convolution" in summary and "no check cheaper" in summary, summary[:600]


def test_a_tied_embedding_whose_gradients_underflow_fp32_squares(tmp_path: Path) -> None:
    """Gradients near 1e-25, the rows of some far smaller: an honest worker's results
    must pass their checks (fp32 row norms of such rows once read zero, and both local
    workers were banned within the first step)."""
    coord, flops = _train(tmp_path, "support.real_models:make_tied_lm_job")
    assert_losses_match(_losses(coord), train_locally(make_tied_lm_job(), STEPS))
    assert flops["workers_share"] >= 0.90, flops
    assert "failed verification" not in coord.output()
