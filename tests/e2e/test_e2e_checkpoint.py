"""Checkpoints and resume: a SIGKILLed coordinator restarted with the same state
directory resumes from its last checkpoint, with the losses of an uninterrupted run and
every verified tile still in the ledger."""

from __future__ import annotations

import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.procs import Coordinator, Worker, assert_losses_match, wait_until
from torch import nn

import coordinator.step.checkpoint as checkpoint
from coordinator.jobs.tiny_gpt import make_job
from coordinator.step.checkpoint import load_checkpoint, save_checkpoint
from coordinator.step.job import Job, train_locally
from coordinator.step.trainer import Trainer


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _mlp_job(schedule: bool = False) -> Job:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(6)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    job = Job(model=model, loss_fn=F.cross_entropy, optimizer=opt, batches=data, name="mlp")
    if schedule:  # a warm-up then a cosine decay, as language models train
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3)
        job.lr_scheduler = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], [3])
        job.clip_grad_norm = 0.5
    return job


@pytest.mark.timeout(60)
def test_save_and_load_round_trip(tmp_path: Path) -> None:
    job = _mlp_job()
    train_locally(job, 2)  # optimizer state worth saving
    rng = torch.get_rng_state()
    path = tmp_path / "checkpoint.pt"
    assert load_checkpoint(path) is None
    save_checkpoint(
        path, model=job.model, optimizer=job.optimizer, step=2, batches_consumed=2, rng_state=rng
    )
    ckpt = load_checkpoint(path)
    assert ckpt is not None
    assert (ckpt.step, ckpt.batches_consumed) == (2, 2)
    assert torch.equal(ckpt.rng_state, rng)
    for name, value in job.model.state_dict().items():
        assert torch.equal(ckpt.model[name], value), name
    assert ckpt.optimizer["state"].keys() == job.optimizer.state_dict()["state"].keys()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


@pytest.mark.timeout(60)
def test_a_crash_mid_write_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _mlp_job()
    path = tmp_path / "checkpoint.pt"
    kwargs: dict[str, Any] = {"model": job.model, "optimizer": job.optimizer}
    save_checkpoint(path, step=3, batches_consumed=3, rng_state=torch.get_rng_state(), **kwargs)

    def torn_save(obj: object, fh: Any) -> None:
        fh.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, step=4, batches_consumed=4, rng_state=torch.get_rng_state(), **kwargs)
    monkeypatch.undo()
    ckpt = load_checkpoint(path)
    assert ckpt is not None and ckpt.step == 3
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temp file left


@pytest.mark.timeout(60)
def test_a_resumed_trainer_continues_like_an_uninterrupted_run(tmp_path: Path) -> None:
    # Dropout: the restored RNG must give the same masks as an uninterrupted run.
    want = train_locally(_mlp_job(), 5)
    path = tmp_path / "checkpoint.pt"
    first = Trainer(_mlp_job(), None, checkpoint_path=path, checkpoint_every=2)
    assert not first.resume()
    steps = [first.train_step() for _ in range(3)]  # checkpoint at step 2; step 3's lost
    first.close()
    # The snapshot's time is reported with the step that took it; the write's CPU with
    # the steps it ran beside (its own thread): the first step has neither.
    assert [r.checkpoint_s > 0 for r in steps[:2]] == [False, True]
    assert steps[0].cpu is not None and steps[0].cpu.get("checkpoint", 0.0) == 0
    assert steps[0].cpu.get("checkpoint_write", 0.0) == 0
    assert sum((r.cpu or {}).get("checkpoint", 0.0) for r in steps) > 0
    assert sum((r.cpu or {}).get("checkpoint_write", 0.0) for r in steps) > 0
    assert first.checkpointed_step == 2
    torch.manual_seed(123)  # a new process starts with some other RNG state
    second = Trainer(_mlp_job(), None, checkpoint_path=path, checkpoint_every=2)
    assert second.resume()
    assert (second.step, second.batches_consumed) == (2, 2)
    records = second.run(3)
    assert [r.step for r in records] == [2, 3, 4]
    got = first.losses[:2] + [r.loss for r in records]
    assert_losses_match(got, want, rel=1e-6)
    ckpt = load_checkpoint(path)
    assert ckpt is not None and ckpt.step == 5  # the clean end is checkpointed too


@pytest.mark.timeout(60)
def test_a_learning_rate_schedule_and_clipping_resume_where_they_were(tmp_path: Path) -> None:
    local = _mlp_job(schedule=True)
    want = train_locally(local, 6)
    # The schedule and the clipping change the trajectory: they are not ignored.
    gaps = [abs(a - b) for a, b in zip(want, train_locally(_mlp_job(), 6), strict=True)]
    assert max(gaps) > 1e-3, gaps
    path = tmp_path / "checkpoint.pt"
    first = Trainer(_mlp_job(schedule=True), None, checkpoint_path=path)
    first.run(3)
    torch.manual_seed(123)  # a new process starts with some other RNG state
    second = Trainer(_mlp_job(schedule=True), None, checkpoint_path=path)
    assert second.resume() and second.step == 3
    records = second.run(3)
    assert_losses_match(first.losses + [r.loss for r in records], want, rel=1e-6)
    lr = second.job.optimizer.param_groups[0]["lr"]
    assert lr == local.optimizer.param_groups[0]["lr"] and lr < 0.01
    # Each step's record says the learning rate its update used.
    schedule = _mlp_job(schedule=True)
    used = []
    for _ in range(6):
        used.append(schedule.optimizer.param_groups[0]["lr"])
        schedule.optimizer.step()
        assert schedule.lr_scheduler is not None
        schedule.lr_scheduler.step()
    assert [r.lr for r in records] == used[3:], (records, used)


@pytest.mark.timeout(60)
def test_the_next_step_computes_while_the_checkpoint_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The write is held on its thread: the next step's forward and backward run, its
    # optimizer step waits for the write, and the file holds the step boundary's state.
    path = tmp_path / "checkpoint.pt"
    trainer = Trainer(_mlp_job(), None, checkpoint_path=path)
    release, writing = threading.Event(), threading.Event()
    writer_threads: list[str] = []
    real_save = checkpoint.torch.save

    def held_save(obj: object, fh: Any) -> None:
        writer_threads.append(threading.current_thread().name)
        writing.set()
        assert release.wait(30)
        real_save(obj, fh)

    monkeypatch.setattr(checkpoint.torch, "save", held_save)
    trainer.train_step()  # returns with its checkpoint still being written
    assert writing.wait(10) and not path.exists()
    at_boundary = {k: v.clone() for k, v in trainer.job.model.state_dict().items()}
    computed = threading.Event()
    writer = trainer._writer
    assert writer is not None
    real_wait = writer.wait

    def wait_after_compute() -> None:
        computed.set()  # the gradients are in: only the optimizer step is left
        real_wait()

    monkeypatch.setattr(writer, "wait", wait_after_compute)
    second = threading.Thread(target=trainer.train_step)
    second.start()
    assert computed.wait(30)  # the second step's GEMMs ran beside the write
    second.join(0.3)
    assert second.is_alive()  # ... and its optimizer step waits for it
    assert all(torch.equal(v, at_boundary[k]) for k, v in trainer.job.model.state_dict().items())
    release.set()
    second.join(30)
    assert not second.is_alive()
    trainer.close()
    assert writer_threads[0] == "cleave-checkpoint"
    ckpt = load_checkpoint(path)
    assert ckpt is not None and ckpt.step == 2  # the second step's own checkpoint, last
    monkeypatch.undo()
    first = Trainer(_mlp_job(), None, checkpoint_path=tmp_path / "again.pt")
    first.train_step()
    first.close()
    ckpt = load_checkpoint(tmp_path / "again.pt")
    assert ckpt is not None
    for name, value in ckpt.model.items():
        assert torch.equal(value, at_boundary[name]), name


@pytest.mark.timeout(60)
def test_a_failed_background_write_stops_training_at_the_next_optimizer_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = Trainer(_mlp_job(), None, checkpoint_path=tmp_path / "checkpoint.pt")

    def full_disk(obj: object, fh: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    trainer.train_step()
    with pytest.raises(OSError, match="disk full"):
        trainer.train_step()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_a_process_whose_trainer_was_never_closed_exits_after_its_last_write(
    tmp_path: Path,
) -> None:
    # No idle writer thread may outlive the trainer: a test or a script that steps a
    # trainer by hand and never closes it must still exit (with its checkpoint whole).
    path = tmp_path / "checkpoint.pt"
    script = (
        "import sys; sys.path[:0] = sys.argv[2:]\n"
        "from pathlib import Path\n"
        "from test_e2e_checkpoint import _mlp_job\n"
        "from coordinator.step.trainer import Trainer\n"
        "t = Trainer(_mlp_job(), None, checkpoint_path=Path(sys.argv[1]))\n"
        "t.train_step(); t.train_step()\n"
    )
    done = subprocess.run(
        # This file's folder, and the tests' (for support.*), as pytest has them.
        [sys.executable, "-c", script, str(path), *map(str, Path(__file__).parents[:2])],
        timeout=90,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    ckpt = load_checkpoint(path)
    assert ckpt is not None and ckpt.step == 2


@pytest.mark.timeout(60)
def test_resume_removes_writes_a_kill_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    trainer = Trainer(_mlp_job(), None, checkpoint_path=path)
    trainer.run(1)
    torn = tmp_path / ".checkpoint.pt.abc123.tmp"
    torn.write_bytes(b"half a checkpoint")
    again = Trainer(_mlp_job(), None, checkpoint_path=path)
    assert again.resume() and again.step == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_killed_coordinator_resumes_from_its_checkpoint_and_credits_each_tile_once(
    tmp_path: Path,
) -> None:
    port, state = _free_port(), tmp_path / "shared-state"
    args = ("--port", str(port), "--state-dir", str(state), "--steps", "8", "--min-workers", "1")
    # Step 3 is done and credited, and the checkpoint holds 3 steps: it runs again.
    args += ("--checkpoint-every", "3", "--planner", "grid")
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = Coordinator(tmp_path / "first", *args)
    worker = Worker(tmp_path, first.url, "steadfast", "--backoff-base", "0.2")
    try:
        wait_until(lambda: len(first.steps()) >= 4, 120, "four steps before the crash")
        first.proc.kill()
        first.wait(10)
        assert (state / "checkpoint.pt").exists()
        second = Coordinator(tmp_path / "second", *args)
        assert second.wait(180) == 0, second.output()
    finally:
        first.kill()
        worker.stop()
    assert worker.proc.returncode == 0, worker.output()
    before, after = first.steps(), second.steps()
    assert after and after[0]["step"] <= len(before), (before, after)
    assert f"resuming from step {after[0]['step']}" in second.output()
    kept: dict[int, dict[str, Any]] = {}
    for record in before + after:
        kept[record["step"]] = record  # a step lost with the crash is recomputed: keep the last
    assert sorted(kept) == list(range(8))
    got = [kept[step]["loss"] for step in range(8)]
    assert_losses_match(got, train_locally(make_job(), 8))
    assert after[0]["step"] == 3, after[0]
    with sqlite3.connect(state / "ledger.sqlite") as db:
        (credited,) = db.execute(
            "SELECT flops FROM contributions WHERE name = 'steadfast'"
        ).fetchone()
    # What the steps' results used, each step once: no credit lost (a commit the kill
    # cut short is paid when its step runs again), none counted twice. Above it, at most
    # a tile paid before the kill that the coordinator had to compute itself the second
    # time (a straggler on a loaded machine).
    used = sum(r["workers_flops"] for r in kept.values())
    one_step = min(r["workers_flops"] for r in kept.values())
    assert one_step > 0
    assert used <= credited < used + one_step, (credited, used, one_step)


# ---- a kill while a large checkpoint is being written ----------------------------------

TORN_STEPS = 6


def make_large_checkpoint_job() -> Job:
    """A small step with a large checkpoint: a 25.6M-parameter embedding table and Adam
    make a ~300 MB file, long enough to write that a kill lands in the middle of one."""
    torch.manual_seed(7)
    vocab, dim, context = 200_000, 128, 8
    model = nn.Sequential(
        nn.Embedding(vocab, dim),
        nn.Flatten(),
        nn.Linear(context * dim, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    g = torch.Generator().manual_seed(8)
    data = [
        (
            torch.randint(0, vocab, (16, context), generator=g),
            torch.randint(0, 10, (16,), generator=g),
        )
        for _ in range(TORN_STEPS)
    ]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return Job(model=model, loss_fn=F.cross_entropy, optimizer=opt, batches=data, name="big_ckpt")


def _torn_writes(state: Path) -> list[Path]:
    return sorted(state.glob(".checkpoint.pt.*.tmp"))


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_coordinator_killed_mid_checkpoint_write_resumes_from_the_previous_one(
    tmp_path: Path,
) -> None:
    port, state = _free_port(), tmp_path / "shared-state"
    path = state / "checkpoint.pt"
    args = (
        *("--port", str(port), "--state-dir", str(state), "--min-workers", "1"),
        *("--steps", str(TORN_STEPS), "--job", "e2e.test_e2e_checkpoint:make_large_checkpoint_job"),
    )
    runs: list[Coordinator] = []
    worker: Worker | None = None
    torn: list[Path] = []
    try:
        # A kill can land just after a write's rename (nothing torn): then the run is
        # restarted and the next write is tried, a few times at most.
        for attempt in range(3):
            (tmp_path / f"run{attempt}").mkdir()
            coord = Coordinator(tmp_path / f"run{attempt}", *args)
            runs.append(coord)
            if worker is None:
                worker = Worker(tmp_path, coord.url, "steadfast", "--backoff-base", "0.2")
            deadline, killed = time.monotonic() + 150, False
            # A write in flight after a complete checkpoint: the kill must leave that one.
            while not killed and coord.proc.poll() is None:
                assert time.monotonic() < deadline, f"no write seen in 150 s:\n{coord.output()}"
                if path.exists() and _torn_writes(state):
                    coord.proc.kill()
                    killed = True
                time.sleep(0.005)
            assert killed, f"run {attempt} ended before a kill caught a write:\n{coord.output()}"
            coord.kill()
            coord.wait(10)
            torn = _torn_writes(state)
            if torn:
                break
        assert torn, "three kills in a row missed the checkpoint writes in flight"
        ckpt = load_checkpoint(path)  # the last complete checkpoint, untouched by the kill
        assert ckpt is not None and 0 < ckpt.step < TORN_STEPS, ckpt and ckpt.step
        # The worker is held until the restarted coordinator has resumed: no step, so no
        # checkpoint write, can start before the torn write's removal is checked.
        assert worker is not None
        worker.proc.send_signal(signal.SIGSTOP)
        (tmp_path / "last").mkdir()
        last = Coordinator(tmp_path / "last", *args)
        runs.append(last)
        wait_until(lambda: "waiting for workers" in last.output(), 60, "the resume")
        assert _torn_writes(state) == [], last.output()
        for cut in torn:
            assert f"discarded {cut.name}: a checkpoint write that was cut short" in last.output()
        worker.proc.send_signal(signal.SIGCONT)
        assert last.wait(180) == 0, last.output()
    finally:
        for coord in runs:
            coord.kill()
        if worker is not None:
            worker.proc.send_signal(signal.SIGCONT)
            worker.stop()
    assert worker is not None and worker.proc.returncode == 0, worker.output()
    assert f"resuming from step {ckpt.step} of {TORN_STEPS}" in last.output(), last.output()
    assert _torn_writes(state) == []
    resumed = last.steps()
    assert resumed and resumed[0]["step"] == ckpt.step, resumed
    kept: dict[int, dict[str, Any]] = {}
    for coord in runs:
        for record in coord.steps():
            kept[record["step"]] = record  # a step lost with a kill is recomputed: keep the last
    assert sorted(kept) == list(range(TORN_STEPS))
    got = [kept[step]["loss"] for step in range(TORN_STEPS)]
    assert_losses_match(got, train_locally(make_large_checkpoint_job(), TORN_STEPS))
    final = load_checkpoint(path)
    assert final is not None and final.step == TORN_STEPS
    with sqlite3.connect(state / "ledger.sqlite") as db:
        (credited,) = db.execute(
            "SELECT flops FROM contributions WHERE name = 'steadfast'"
        ).fetchone()
    # No credit lost: at least what the steps' results used, each step once.
    assert credited >= sum(r["workers_flops"] for r in kept.values()) > 0
