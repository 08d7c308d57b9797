"""``cleave-coordinator serve --ranks 2``: two coordinator ranks on torch.distributed
(gloo over loopback), each with its own port, state directory and local worker, train
the built-in GPT on halves of each batch under one job key; the losses equal local
torch on the whole batch; the same ranks started by ``torchrun`` resume from their
checkpoints and go on matching it. A batch that does not split across the ranks stops
the run with the sizes."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from procs import Coordinator, assert_losses_match, env_for

from coordinator.jobs.tiny_gpt import GPTConfig, make_job
from coordinator.step.job import Job, train_locally

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]
STEPS = 4


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

    # The same two ranks as torchrun starts them: each resumes from its own checkpoint.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master_port = s.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    serve = ["-m", "coordinator", "serve", "--host", "127.0.0.1", "--port", "0"]
    serve += ["--state-dir", str(coord.state), "--metrics-out", str(coord.metrics)]
    serve += ["--planner", "grid", "--steps", str(STEPS + 2), "--local-workers", "1"]
    done = subprocess.run(
        [*torchrun, *serve],
        cwd=tmp_path,
        env=env_for(tmp_path / "coord-config"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resuming from step {STEPS}" in done.stdout, done.stdout
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
        "test_e2e_ranks:make_odd_batch_job",
    )
    assert coord.wait(300) != 0
    out = coord.output()
    assert "a batch of 3 rows" in out and "across 2 coordinator ranks" in out, out
    assert "Traceback" not in out, out
