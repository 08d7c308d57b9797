"""``cleave-coordinator serve --ranks 2``: two coordinator ranks on torch.distributed
(gloo over loopback), each with its own port, state directory and local worker, train
the built-in GPT on halves of each batch under one job key; the losses equal local
torch on the whole batch; the same ranks started by ``torchrun`` resume from the newest
checkpoint either holds and go on matching it, crediting each step's work once. A
GPT-2-style transformer trains like local torch too, and a BatchNorm CNN as
data-parallel torch trains it (each rank's batch statistics, rank 0's running statistics
on every rank). A batch that does not split
across the ranks stops the run with the sizes."""

from __future__ import annotations

import json
import re
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from support.procs import Coordinator, Worker, assert_losses_match, env_for, wait_until
from support.real_models import make_cnn_job, make_sdpa_job

from coordinator.jobs.tiny_gpt import GPTConfig, make_job
from coordinator.step.checkpoint import load_checkpoint
from coordinator.step.job import Job, train_locally
from coordinator.step.ranks import Ranks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]
STEPS = 4


def torchrun(tmp: Path, *serve: str, options: tuple[str, ...] = ()) -> list[str]:
    """torchrun (with ``options``) starting two ranks of ``serve`` on this host, on the
    state directory and metrics file a ``Coordinator`` in ``tmp`` uses."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master_port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(master_port), *options]
    cmd += ["-m", "coordinator", "serve", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--state-dir", str(tmp / "state"), "--metrics-out", str(tmp / "metrics.jsonl")]
    return [*cmd, "--planner", "grid", "--local-workers", "1", *serve]


def make_odd_batch_job() -> Job:
    return make_job(cfg=GPTConfig(batch_size=3))


def test_two_ranks_train_the_builtin_gpt_like_local_torch_on_the_whole_batch(
    tmp_path: Path,
) -> None:
    coord = Coordinator(tmp_path, "--ranks", "2", "--steps", str(STEPS), "--local-workers", "1")
    assert coord.wait(300) == 0, coord.output()
    out = coord.output()
    assert "rank:            0 of 2" in out and "rank:            1 of 2" in out, out
    records = coord.steps()  # rank 0's: the global batch's loss
    assert len(records) == STEPS and all(r["tiles"] > 0 for r in records), records
    assert_losses_match([r["loss"] for r in records], train_locally(make_job(), STEPS))
    for rank in (0, 1):  # each rank has its own state (ledger, checkpoint), not its own key
        state = coord.state / f"rank-{rank}"
        assert (state / "checkpoint.pt").exists() and not (state / "coordinator.key").exists()
    assert (coord.state / "coordinator.key").exists()
    fingerprints = set(re.findall(r"key fingerprint: (\S+)", out))
    assert len(fingerprints) == 1, fingerprints  # both ranks speak for one job key
    assert json.loads(coord.metrics.read_text().splitlines()[-1])["step"] == STEPS - 1

    # The same two ranks as torchrun starts them, rank 1's checkpoint lost (as a rank
    # killed before its first write, or a host whose disk was replaced): both go on from
    # rank 0's.
    (coord.state / "rank-1" / "checkpoint.pt").unlink()
    done = subprocess.run(
        torchrun(tmp_path, "--steps", str(STEPS + 2)),
        cwd=tmp_path,
        env=env_for(tmp_path / "coord-config"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert f"rank 1: resuming from rank 0's checkpoint of step {STEPS}" in out, out
    assert f"resuming from step {STEPS}" in out, out
    losses = [r["loss"] for r in coord.steps()]
    assert len(losses) == STEPS + 2, losses
    assert_losses_match(losses, train_locally(make_job(), STEPS + 2))


def test_a_batch_that_does_not_split_across_the_ranks_is_refused_with_its_sizes(
    tmp_path: Path,
) -> None:
    coord = Coordinator(
        tmp_path,
        "--ranks",
        "2",
        "--steps",
        "2",
        "--local-workers",
        "1",
        "--job",
        "e2e.test_e2e_ranks:make_odd_batch_job",
    )
    assert coord.wait(300) != 0
    out = coord.output()
    assert "a batch of 3 rows" in out and "across 2 coordinator ranks" in out, out
    assert "Traceback" not in out, out


def test_two_ranks_train_a_gpt2_style_transformer_like_local_torch(tmp_path: Path) -> None:
    coord = Coordinator(
        tmp_path,
        *("--ranks", "2", "--steps", str(STEPS), "--local-workers", "1"),
        *("--job", "support.real_models:make_sdpa_job"),
    )
    assert coord.wait(300) == 0, coord.output()
    records = coord.steps()
    assert len(records) == STEPS and all(r["tiles"] > 0 for r in records), records
    assert_losses_match([r["loss"] for r in records], train_locally(make_sdpa_job(), STEPS))


def train_as_ranks(job: Job, steps: int, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Data-parallel training as DistributedDataParallel does it, in one process: each
    rank's slice of the batch through the model (BatchNorm with that slice's statistics),
    the gradients averaged, the mean loss, rank 0's buffers kept. The losses and the
    buffers at the end."""
    model, buffers = job.model, dict(job.model.named_buffers())
    losses = []
    for _ in range(steps):
        batch = job.next_batch()
        start = {name: b.clone() for name, b in buffers.items()}
        grads: list[torch.Tensor] = []
        step_losses: list[float] = []
        rank0: dict[str, torch.Tensor] = {}
        for rank in range(world):
            for name, b in buffers.items():
                b.copy_(start[name])
            inputs, targets = Ranks(rank, world).slice(batch)
            job.optimizer.zero_grad(set_to_none=True)
            loss = job.loss_fn(model(inputs), targets)
            loss.backward()
            step_losses.append(float(loss.detach()))
            got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            grads = got if not grads else [g + h for g, h in zip(grads, got, strict=True)]
            if rank == 0:
                rank0 = {name: b.clone() for name, b in buffers.items()}
        for p, g in zip([p for p in model.parameters() if p.grad is not None], grads, strict=True):
            p.grad = g / world
        for name, b in buffers.items():
            b.copy_(rank0[name])
        job.optimizer.step()
        losses.append(sum(step_losses) / world)
    return losses, {name: b.detach().clone() for name, b in buffers.items()}


def test_two_ranks_train_a_batchnorm_cnn_as_data_parallel_torch_does(tmp_path: Path) -> None:
    coord = Coordinator(
        tmp_path,
        *("--ranks", "2", "--steps", str(STEPS), "--local-workers", "1"),
        *("--job", "support.real_models:make_cnn_job"),
    )
    assert coord.wait(300) == 0, coord.output()
    want_losses, want_buffers = train_as_ranks(make_cnn_job(), STEPS, 2)
    assert_losses_match([r["loss"] for r in coord.steps()], want_losses)
    assert any("running_mean" in name for name in want_buffers)
    # Both replicas hold rank 0's running statistics. They follow the reference to the
    # rounding of the activations they average (the workers' GEMMs, not torch's
    # convolution kernels), far inside what one rank's slice differs from the other's.
    for rank in (0, 1):
        ckpt = load_checkpoint(coord.state / f"rank-{rank}" / "checkpoint.pt")
        assert ckpt is not None and ckpt.step == STEPS
        for name, want in want_buffers.items():
            torch.testing.assert_close(
                ckpt.model[name], want, rtol=1e-3, atol=1e-4, msg=f"rank {rank}: {name}"
            )


def test_a_rank_killed_mid_run_is_restarted_by_torchrun_and_the_losses_still_match(
    tmp_path: Path,
) -> None:
    steps = 8
    log = (tmp_path / "torchrun.log").open("wb")
    run = subprocess.Popen(
        torchrun(tmp_path, "--steps", str(steps), options=("--max-restarts", "1")),
        cwd=tmp_path,
        env=env_for(tmp_path / "coord-config"),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
            assert run.poll() is None and time.monotonic() < deadline, (
                tmp_path / "torchrun.log"
            ).read_text()
            time.sleep(0.2)
        rank1 = [p for p in psutil.Process(run.pid).children(recursive=True) if _is_rank(p, 1)]
        assert len(rank1) == 1, rank1
        rank1[0].kill()  # SIGKILL, mid-step: rank 0 has finished 3 steps
        assert run.wait(300) == 0, (tmp_path / "torchrun.log").read_text()
    finally:
        if run.poll() is None:
            run.kill()
        log.close()
    out = (tmp_path / "torchrun.log").read_text()
    assert "resuming from step" in out, out
    by_step = {}  # the steps after the checkpoint ran twice: the second run's records
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record
    assert sorted(by_step) == list(range(steps)), by_step
    losses = [by_step[s]["loss"] for s in range(steps)]
    assert_losses_match(losses, train_locally(make_job(), steps))
    # Each rank's ledger credits each step once, the steps run again included: what the
    # results used (the ranks' halves have one shape: rank 1 hands out what rank 0 does),
    # and above it at most a tile paid before the kill that a rank computed itself after.
    credited = 0
    for rank in range(2):
        with sqlite3.connect(tmp_path / "state" / f"rank-{rank}" / "ledger.sqlite") as db:
            credited += db.execute("SELECT SUM(flops) FROM contributions").fetchone()[0]
    used = 2 * sum(r["workers_flops"] for r in by_step.values())
    one_step = min(r["workers_flops"] for r in by_step.values())
    assert used <= credited < used + one_step, (credited, used, one_step)


def _is_rank(proc: psutil.Process, rank: int) -> bool:
    """A coordinator rank's process (not its local worker, which inherits its environment)."""
    try:
        cmdline = proc.cmdline()
        return "coordinator" in cmdline and proc.environ().get("RANK") == str(rank)
    except psutil.Error:
        return False


def test_ranks_on_one_host_listen_on_loopback_only_and_each_shows_every_rank(
    tmp_path: Path,
) -> None:
    """torch.distributed's store and gloo links are not authenticated: ``serve --ranks``
    meets through a file and links over loopback, so the only ports its ranks open are
    their WebSocket ones (here on 127.0.0.1) and gloo's on loopback. A rank's status and
    metrics show every rank."""
    coord = Coordinator(tmp_path, "--ranks", "2", "--steps", "100000", "--local-workers", "1")
    try:
        wait_until(lambda: len(coord.steps()) >= 1, 240, "a step trained by both ranks")
        tree = psutil.Process(coord.proc.pid).children(recursive=True)
        ranks = [p for p in tree if _is_rank(p, 0) or _is_rank(p, 1)]
        assert len(ranks) == 2, tree
        listening = [
            (p.pid, c.laddr)
            for p in ranks
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        # Each rank's WebSocket port and gloo's listener, all on loopback.
        assert listening and {addr.ip for _, addr in listening} == {"127.0.0.1"}, listening

        urls = set(re.findall(r"on (ws://127\.0\.0\.1:\d+/ws)", coord.output()))
        assert len(urls) == 2, coord.output()

        def both_ranks_seen() -> bool:
            status = coord.status()
            return {r.get("url") for r in status["ranks"]} == urls and status["ranks_total"][
                "workers"
            ] == 2

        wait_until(both_ranks_seen, 60, "both ranks, with a worker each, in one rank's status")
        status = coord.status()
        assert status["rank"]["world"] == 2 and all(r["age_s"] < 30 for r in status["ranks"])
        with urllib.request.urlopen(coord.http + "/metrics", timeout=30) as response:
            metrics = response.read().decode()
        rank = status["rank"]["rank"]
        assert f'cleave_ranks{{rank="{rank}"}} 2.0' in metrics, metrics
        assert f'cleave_tiles_verified_total{{rank="{rank}"}}' in metrics, metrics
    finally:
        coord.stop()


def test_workers_given_one_ranks_url_are_spread_over_the_ranks_by_its_welcome(
    tmp_path: Path,
) -> None:
    coord = Coordinator(tmp_path, "--ranks", "2", "--steps", "100000", "--min-workers", "1")
    workers: list[Worker] = []
    try:

        def view(http: str = coord.http) -> list[dict[str, Any]]:
            with urllib.request.urlopen(http + "/api/status", timeout=30) as response:
                ranks: list[dict[str, Any]] = json.load(response)["ranks"]
            return ranks

        wait_until(lambda: all(r["heard"] for r in view()), 60, "both ranks in the view")
        urls = [r["url"] for r in view()]
        rank0 = urls[0].replace("ws://", "http://").removesuffix("/ws")
        wait_until(lambda: all(r["heard"] for r in view(rank0)), 60, "rank 1, heard at rank 0")
        # Both workers are given rank 0's URL. The first stays (no rank has fewer); the
        # second is welcomed and sent on to rank 1, which it then serves.
        workers.append(Worker(tmp_path, urls[0], "first"))
        wait_until(lambda: view(rank0)[0]["workers"] == 1, 60, "the first worker at rank 0")
        workers.append(Worker(tmp_path, urls[0], "second"))
        seen: list[Any] = []

        def spread() -> bool:
            seen[:] = view()
            return [r["workers"] for r in seen] == [1, 1]

        try:
            wait_until(spread, 60, "a worker at each rank")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: the ranks {seen}") from None
        wait_until(lambda: len(coord.steps()) >= 2, 120, "steps trained by both ranks")
        second = workers[1].output()
        assert f"sent on to {urls[1]}" in second, second
        assert "serving coordinator rank 1 of 2" in second, second
        first = workers[0].output()
        assert "serving coordinator rank 0 of 2" in first and "sent on" not in first, first
        # Each rank publishes its summary every rank_view.PERIOD_S, so the steps counted
        # above can be newer than the view: wait for the view to show their tiles.
        wait_until(
            lambda: sum(r.get("tiles_verified") or 0 for r in view()) > 0,
            60,
            "verified tiles in the ranks' view",
        )
    finally:
        for worker in workers:
            worker.stop()
        coord.stop()
