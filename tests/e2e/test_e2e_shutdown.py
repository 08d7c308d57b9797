"""Clean shutdown: on SIGTERM the coordinator checkpoints the last completed step before it
stops its workers and exits 143, and a restart resumes from exactly there."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F
from support.procs import Coordinator, assert_losses_match, wait_until
from torch import nn

from coordinator.jobs.tiny_gpt import make_job
from coordinator.run import EXIT_TERMINATED
from coordinator.step.checkpoint import load_checkpoint
from coordinator.step.executor import StepCancelled
from coordinator.step.job import Job, train_locally
from coordinator.step.trainer import Trainer


def _dropout_job(cancel_at_batch: int | None = None, cancel: threading.Event | None = None) -> Job:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(8)
    ]

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i, batch in enumerate(data):
            if i == cancel_at_batch and cancel is not None:
                torch.rand(5)  # the abandoned step moved the RNG: the checkpoint must not
                cancel.set()  # the signal arrives while this step is in flight
            yield batch

    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return Job(model=model, loss_fn=F.cross_entropy, optimizer=opt, batches=batches(), name="mlp")


@pytest.mark.timeout(60)
def test_a_step_abandoned_mid_way_checkpoints_the_step_before_it(tmp_path: Path) -> None:
    want = train_locally(_dropout_job(), 6)
    path = tmp_path / "checkpoint.pt"
    cancel = threading.Event()
    first = Trainer(
        _dropout_job(cancel_at_batch=3, cancel=cancel),
        None,
        cancel=cancel,
        checkpoint_path=path,
        checkpoint_every=1000,  # no periodic checkpoint: only the one taken on the way out
    )
    with pytest.raises(StepCancelled):
        first.run(6)
    assert first.step == 3 and first.batches_consumed == 4  # step 3 took its batch
    ckpt = load_checkpoint(path)
    assert ckpt is not None and (ckpt.step, ckpt.batches_consumed) == (3, 3)
    torch.manual_seed(99)
    second = Trainer(_dropout_job(), None, checkpoint_path=path)
    assert second.resume() and second.step == 3
    got = first.losses + [r.loss for r in second.run(3)]
    assert_losses_match(got, want, rel=1e-6)  # the same dropout masks, the same data


@pytest.mark.timeout(60)
def test_a_cancel_between_steps_takes_no_batch(tmp_path: Path) -> None:
    cancel = threading.Event()
    cancel.set()
    trainer = Trainer(_dropout_job(), None, cancel=cancel, checkpoint_path=tmp_path / "c.pt")
    with pytest.raises(StepCancelled):
        trainer.run(2)
    assert trainer.batches_consumed == 0
    ckpt = load_checkpoint(tmp_path / "c.pt")
    assert ckpt is not None and ckpt.step == 0


def _printed_steps(output: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step +(\d+) +loss", output, flags=re.MULTILINE)]


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_sigterm_checkpoints_the_last_step_then_a_restart_resumes(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    common = ("--state-dir", str(state), "--local-workers", "1", "--checkpoint-every", "1000")
    first = Coordinator(tmp_path / "first", *common, "--steps", "200")
    try:
        wait_until(lambda: len(_printed_steps(first.output())) >= 3, 150, "three steps")
        first.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = first.wait(60)
        stop_s = time.monotonic() - sent
    finally:
        first.kill()
    out = first.output()
    assert code == EXIT_TERMINATED == 143, out
    assert stop_s < 30, f"took {stop_s:.1f} s to stop"
    printed = _printed_steps(out)
    assert printed == list(range(len(printed))), printed
    last = printed[-1]
    ckpt = load_checkpoint(state / "checkpoint.pt")
    assert ckpt is not None and ckpt.step == last + 1, (ckpt and ckpt.step, last)
    assert f"checkpoint: step {last + 1}" in out
    assert "stopped by SIGTERM" in out
    # The checkpoint came before the workers were stopped.
    assert out.index(f"checkpoint: step {last + 1}") < out.index("stopped by SIGTERM")

    total = last + 3
    second = Coordinator(tmp_path / "second", *common, "--steps", str(total))
    try:
        assert second.wait(180) == 0, second.output()
    finally:
        second.kill()
    assert f"resuming from step {last + 1} of {total}" in second.output()
    records = first.steps() + second.steps()
    assert [r["step"] for r in records] == list(range(total)), records
    assert_losses_match([r["loss"] for r in records], train_locally(make_job(), total))


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_json_logs_carry_the_step_records(tmp_path: Path) -> None:
    coord = Coordinator(
        tmp_path, "--steps", "2", "--local-workers", "1", "--log-format", "json", "--fresh"
    )
    try:
        assert coord.wait(100) == 0, coord.output()
    finally:
        coord.kill()
    records = [json.loads(line) for line in coord.output().splitlines()]
    for record in records:
        assert {"time", "level", "logger", "message"} <= record.keys(), record
    steps = [r for r in records if r.get("event") == "step"]
    assert [r["step"] for r in steps] == [0, 1]
    assert all(isinstance(r["loss"], float) and r["tiles"] > 0 for r in steps), steps
    assert steps[0]["message"].startswith("step    0  loss")
    assert any(r["logger"] == "cleave.coordinator" for r in records)  # diagnostics too


def make_unreduced_loss_job() -> Job:
    """The common mistake: a per-example loss left unreduced."""
    job = _dropout_job()
    job.loss_fn = lambda out, y: F.cross_entropy(out, y, reduction="none")
    return job


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_mistake_in_the_job_stops_the_run_with_what_to_change(tmp_path: Path) -> None:
    coord = Coordinator(
        tmp_path,
        *("--job", "e2e.test_e2e_shutdown:make_unreduced_loss_job"),
        *("--steps", "3", "--local-workers", "1", "--fresh"),
    )
    try:
        assert coord.wait(100) == 1, coord.output()
    finally:
        coord.kill()
    out = coord.output()
    assert (
        "error: training failed: Job.loss_fn must return one number, not a tensor of shape [8]"
        in out
    ), out
    # Said once, as what to change: no capture warning first, no stack trace.
    assert "cannot be captured" not in out and "Traceback" not in out, out


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_run_whose_local_workers_all_exit_stops_with_its_last_step_checkpointed(
    tmp_path: Path,
) -> None:
    # Banned or crashed, local workers do not come back; with no other worker connected
    # the step's tiles would wait forever.
    coord = Coordinator(tmp_path, "--steps", "500", "--local-workers", "2", "--fresh")
    try:
        wait_until(lambda: len(_printed_steps(coord.output())) >= 2, 150, "two steps")
        for worker in psutil.Process(coord.proc.pid).children():
            worker.kill()
        code = coord.wait(60)
    finally:
        coord.kill()
    out = coord.output()
    assert code == 1, out
    assert "error: all 2 local workers exited during training" in out, out
    ckpt = load_checkpoint(coord.state / "checkpoint.pt")
    assert ckpt is not None and ckpt.step == len(_printed_steps(out)), out
