"""Models as outsiders write them, in-process: the trainer captures or falls back, lowers
attention and convolutions to GEMMs, counts every op's FLOPs and who computed them, and
trains bf16 autocast jobs with bf16 GEMMs. Losses are compared with ``train_locally``.

The end-to-end tier (real workers over sockets) is tests/e2e/test_e2e_models.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.real_models import (
    make_cnn_job,
    make_convnext_job,
    make_data_dependent_job,
    make_decoder_job,
    make_moe_job,
    make_moe_loop_job,
    make_resnext_job,
    make_sdpa_job,
)
from support.recording_offload import BF16_REL, RecordingOffload
from support.small_nets import repeated_batch_job
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from coordinator.jobs.tiny_gpt import make_bf16_job
from coordinator.step.flops import FlopTally, describe
from coordinator.step.job import Job, train_locally
from coordinator.step.tracing import CaptureError, trace_step
from coordinator.step.trainer import Trainer

pytestmark = pytest.mark.timeout(120)


def _distributed(make: Any, steps: int) -> tuple[Trainer, RecordingOffload, list[float]]:
    offload = RecordingOffload()
    trainer = Trainer(make(), offload)
    records = trainer.run(steps)
    return trainer, offload, [r.loss for r in records]


def _assert_close(got: list[float], want: list[float], rel: float) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rel * abs(w), f"step {step}: {g!r} vs local {w!r}"


def test_transformer_with_fused_attention_trains_with_every_flop_offloaded() -> None:
    def make() -> Job:
        return make_sdpa_job(seq=64, batch=2)

    trainer, offload, losses = _distributed(make, 4)
    _assert_close(losses, train_locally(make(), 4), 1e-5)
    assert trainer.flops["workers_share"] == 1.0 and trainer.flops["kept_here"] == []
    assert sum(op == "bmm" for _, op, _ in offload.calls) == 4 * 2 * 7


@pytest.mark.parametrize("groups", [2, 1])
def test_cnn_trains_and_its_flops_are_torchs_count(groups: int) -> None:
    def make() -> Job:
        return make_cnn_job(batch=4, size=16, groups=groups)

    trainer, _, losses = _distributed(make, 3)
    _assert_close(losses, train_locally(make(), 3), 1e-5)
    assert trainer.flops["workers_share"] == 1.0
    if groups > 1:
        return  # torch counts a grouped convolution's weight gradient as if ungrouped
    # Every convolution went out as GEMMs, and the step's FLOPs are what torch's own
    # counter finds in an eager step of the same model.
    job = make()
    x, y = job.next_batch()
    with FlopCounterMode(display=False) as counter:
        job.loss_fn(job.model(x), y).backward()
    assert trainer.flops["gflop"] == pytest.approx(counter.get_total_flops() / 1e9, abs=1e-4)


def test_transposed_convolutions_go_to_workers() -> None:
    trainer, offload, losses = _distributed(make_decoder_job, 3)
    _assert_close(losses, train_locally(make_decoder_job(), 3), 1e-5)
    assert {op for _, op, _ in offload.calls} >= {"unfold_mm", "mm"}
    # A transposed convolution's FLOPs are 2 per input entry and weight it meets: every
    # layer's forward, its input and weight gradients (none for the batch itself).
    # (torch's own counter counts a transposed convolution's backward otherwise.)
    forward = {
        "fc": 2 * 4 * 16 * 512,
        "up1": 2 * 4 * 32 * 4 * 4 * 16 * 4 * 4,
        "up2": 2 * 4 * 16 * 8 * 8 * 8 * 3 * 3,
        "wave": 2 * 4 * 16 * 16 * 8 * 8,
        "to_rgb": 2 * 4 * 16 * 16 * 3 * 16 * 3 * 3,
    }
    total = 3 * sum(forward.values()) - forward["fc"]
    assert trainer.flops["gflop"] == pytest.approx(total / 1e9, abs=1e-4)
    # Only the last convolution, to three colours, is too narrow to tile: its forward,
    # input gradient and weight gradient stayed here.
    kept = {k["op"] for k in trainer.flops["kept_here"]}
    assert kept == {"convolution", "convolution_backward"}, trainer.flops
    kept_gflop = (1 - trainer.flops["workers_share"]) * trainer.flops["gflop"]
    assert kept_gflop == pytest.approx(3 * forward["to_rgb"] / 1e9, abs=1e-4)


def test_without_workers_the_accounting_names_what_stayed_here() -> None:
    trainer = Trainer(make_cnn_job(batch=4, size=16), None)
    trainer.run(1)
    assert trainer.flops["workers_share"] == 0.0
    kept = {k["op"]: k for k in trainer.flops["kept_here"]}
    assert set(kept) == {"mm", "addmm", "unfold_mm"}, kept  # convolutions as their GEMMs
    assert "planner" in kept["mm"]["why"]
    assert "workers computed 0.0%" in describe(trainer.flops)


def test_tally_describes_the_ops_kept_here() -> None:
    tally = FlopTally(workers=900)
    tally.keep("convolution", 100)
    tally.keep("relu", 0)
    summary = tally.summary()
    assert summary["workers_share"] == 0.9 and [k["op"] for k in summary["kept_here"]] == [
        "convolution"
    ]
    assert describe(summary).startswith("workers computed 90.0% of this step's 0.00 GFLOP")
    assert "convolution 10.00% (fewer than 8 output channels" in describe(summary)


def _why_not_captured(job: Job) -> str:
    x, y = job.next_batch()
    with pytest.raises(CaptureError) as caught:
        trace_step(job, x, y)
    return caught.value.reason


def test_data_dependent_python_is_named_and_the_step_runs_eagerly() -> None:
    job = make_data_dependent_job()
    x, y = job.next_batch()
    reason = _why_not_captured(make_data_dependent_job())
    assert ".item()" in reason and "real_models.py:" in reason
    trainer, offload, losses = _distributed(make_data_dependent_job, 5)
    _assert_close(losses, train_locally(make_data_dependent_job(), 5), 1e-5)
    assert not trainer.tracer.get(x, y)  # the failed capture is remembered, not retried
    assert trainer.flops["workers_share"] == 1.0
    # The forward's and the backward's GEMMs (attention included) all went out.
    per_step = len(offload.calls) / 5
    assert per_step >= 3 * 4 + 7, offload.calls[:10]


def test_bf16_autocast_job_sends_bf16_gemms_and_follows_local_training() -> None:
    trainer, offload, losses = _distributed(make_bf16_job, 5)
    _assert_close(losses, train_locally(make_bf16_job(), 5), BF16_REL)
    assert {dtype for _, _, dtype in offload.calls} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in trainer.job.model.parameters())


def test_tiles_the_server_computed_itself_count_as_kept_here() -> None:
    tally = FlopTally(workers=1000)
    tally.computed_here_after_all(250)
    assert tally.workers == 750 and tally.kept == {"stranded tiles": 250}
    assert tally.summary()["kept_here"][0]["why"].startswith("no connected worker")


@pytest.mark.parametrize("make", [make_moe_job, make_moe_loop_job, make_resnext_job])
def test_experts_and_grouped_convolutions_train_with_every_flop_offloaded(make: Any) -> None:
    trainer, offload, losses = _distributed(make, 4)
    _assert_close(losses, train_locally(make(), 4), 1e-5)
    assert trainer.flops["workers_share"] == 1.0, trainer.flops
    if make is make_moe_job:  # one graph; each grouped GEMM went out as its groups' mm
        assert trainer.tracer.failures == {}
        assert any(".g" in name for name, _, _ in offload.calls), offload.calls[:5]


def test_a_shape_taken_from_data_is_named_and_the_step_runs_eagerly() -> None:
    reason = _why_not_captured(make_moe_loop_job())
    assert "torch.where(cond)" in reason and "real_models.py:" in reason, reason


class _Checkpointed(torch.nn.Module):
    """Blocks under activation checkpointing, as a library's
    ``gradient_checkpointing_enable()`` wraps them."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.embed = torch.nn.Linear(32, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(2))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)  # reentrant checkpointing needs an input that takes gradients
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant).relu()
        return self.head(x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_is_named_and_the_step_runs_eagerly(reentrant: bool) -> None:
    def make() -> Job:
        torch.manual_seed(0)
        return repeated_batch_job(_Checkpointed(reentrant), rows=16, features=32, steps=3)

    reason = _why_not_captured(make())
    assert "activation checkpointing" in reason and "test_real_models.py:" in reason, reason
    assert "turn it off" in reason, reason
    trainer, _, losses = _distributed(make, 3)
    _assert_close(losses, train_locally(make(), 3), 1e-6)
    assert trainer.flops["workers_share"] == 1.0


def test_depthwise_convolutions_stay_here_and_say_why() -> None:
    trainer, _, losses = _distributed(make_convnext_job, 3)
    _assert_close(losses, train_locally(make_convnext_job(), 3), 1e-5)
    kept = {k["op"]: k for k in trainer.flops["kept_here"]}
    assert set(kept) == {"depthwise convolution"}, kept  # forward and backward
    assert "no check cheaper than computing it" in kept["depthwise convolution"]["why"]
    assert trainer.flops["workers_share"] >= 0.90, trainer.flops
