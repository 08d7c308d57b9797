"""End to end: a real coordinator and real worker processes over loopback WebSockets.

Every test compares the distributed run's per-step losses with plain local torch
training of the same job from the same seed (1e-5 relative).
"""

from __future__ import annotations

import math
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support.procs import Coordinator, Worker, assert_losses_match, wait_until

from coordinator import Job, train_locally
from coordinator.jobs.tiny_gpt import make_job as make_tiny_gpt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


# ---- a model that exists only in this file, served through --job --------------------


class SharedWeightAttention(nn.Module):
    """An MLP whose weight is used twice, around a hand-written attention (torch.bmm)."""

    def __init__(self, d: int = 96, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.inp = nn.Linear(d, d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.shared = nn.Linear(d, d)  # applied twice below
        self.out = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = torch.tanh(self.inp(x))
        q, k, v = self.qkv(h).chunk(3, dim=-1)  # each (B, T, C)

        def split(t: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B*heads, T, C/heads)
            return (
                t.reshape(B, T, self.heads, C // self.heads)
                .transpose(1, 2)
                .reshape(B * self.heads, T, C // self.heads)
            )

        att = torch.bmm(split(q), split(k).transpose(1, 2)) / math.sqrt(C // self.heads)
        y = torch.bmm(att.softmax(-1), split(v))  # (B*heads, T, C/heads)
        y = y.reshape(B, self.heads, T, C // self.heads).transpose(1, 2).reshape(B, T, C)
        h = h + F.relu(self.shared(y))
        h = h + F.relu(self.shared(h))  # same weight, second use
        return self.out(h.mean(dim=1))


def make_shared_attention_job() -> Job:
    torch.manual_seed(1234)
    model = SharedWeightAttention()
    gen = torch.Generator().manual_seed(99)
    data = [
        (torch.randn(8, 24, 96, generator=gen), torch.randint(0, 10, (8,), generator=gen))
        for _ in range(64)
    ]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return Job(
        model=model, loss_fn=F.cross_entropy, optimizer=opt, batches=data, name="shared_attention"
    )


# ---- tests ----------------------------------------------------------------------------


def _ledger(state: Path) -> dict[str, int]:
    with sqlite3.connect(state / "ledger.sqlite") as db:
        return dict(db.execute("SELECT name, tiles FROM contributions").fetchall())


def test_builtin_job_two_local_workers_matches_local_torch(tmp_path: Path) -> None:
    steps = 10
    coord = Coordinator(tmp_path, "--steps", str(steps), "--local-workers", "2")
    assert coord.wait(180) == 0, coord.output()
    records = coord.steps()
    assert_losses_match([r["loss"] for r in records], train_locally(make_tiny_gpt(), steps))
    assert all(r["tiles"] > 0 and r["workers"] == 2 for r in records), records
    ledger = _ledger(coord.state)
    assert ledger.get("local-0", 0) > 0 and ledger.get("local-1", 0) > 0, ledger
    assert sum(ledger.values()) == sum(r["tiles"] for r in records)
    out = coord.output()
    assert "contributions" in out and "local-0" in out and "local-1" in out


def test_model_defined_in_test_file_through_job_contract(tmp_path: Path) -> None:
    steps = 10
    coord = Coordinator(
        tmp_path,
        "--job",
        "e2e.test_e2e_training:make_shared_attention_job",
        "--steps",
        str(steps),
        "--local-workers",
        "2",
    )
    assert coord.wait(180) == 0, coord.output()
    records = coord.steps()
    assert_losses_match(
        [r["loss"] for r in records], train_locally(make_shared_attention_job(), steps)
    )
    assert all(r["tiles"] > 0 for r in records)
    assert records[0]["gemms_offloaded"] >= 8, records[0]  # bmm, addmm and mm all went out
    ledger = _ledger(coord.state)
    assert ledger.get("local-0", 0) > 0 and ledger.get("local-1", 0) > 0, ledger


def test_sigkill_of_a_worker_mid_step_reissues_its_tiles(tmp_path: Path) -> None:
    steps = 6
    coord = Coordinator(tmp_path, "--steps", str(steps), "--min-workers", "2")
    victim = Worker(tmp_path, coord.url, "victim")
    survivor = Worker(tmp_path, coord.url, "survivor")
    try:
        wait_until(lambda: len(coord.steps()) >= 2, 120, "two finished steps")
        # Freeze the victim first so that it is certainly holding tiles when it dies.
        victim.proc.send_signal(signal.SIGSTOP)

        def victim_in_flight() -> int:
            workers = coord.status()["workers"]
            return sum(w["in_flight"] for w in workers if w["name"] == "victim")

        def victim_holds_tiles() -> bool:
            # Results it sent just before it froze may still be on their way: only a
            # count that stays above zero means tiles it will never return.
            if victim_in_flight() == 0:
                return False
            time.sleep(0.3)
            return victim_in_flight() > 0

        wait_until(victim_holds_tiles, 30, "the frozen victim to hold tiles")
        victim.proc.send_signal(signal.SIGKILL)
        assert coord.wait(180) == 0, coord.output()
    finally:
        victim.stop()
        survivor.stop()
    records = coord.steps()
    assert_losses_match([r["loss"] for r in records], train_locally(make_tiny_gpt(), steps))
    assert sum(r["reissued"] for r in records) > 0, records
    assert records[-1]["workers"] == 1
    # Every verified tile was credited exactly once, none of them twice.
    ledger = _ledger(coord.state)
    assert sum(ledger.values()) == sum(r["tiles"] for r in records), ledger
