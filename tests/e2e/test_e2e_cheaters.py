"""End to end, real processes on 127.0.0.1: one cheating worker for every cheat the
result check is calibrated against, next to one honest worker.

The job's GEMMs reach K = 1024 (forward and input gradients of 1024-wide layers), where
the check's old worst-case tolerance let half-precision products and small scales
through. Every cheater's every wrong result must be rejected, none credited, each key
banned, and the run must end with the losses of local torch.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support.procs import TESTS, Coordinator, Worker, assert_losses_match, wait_until
from support.real_models import make_cnn_job

from bench.tile_cases import CHEATS
from coordinator import Job, train_locally

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

STEPS = 6  # all bans fall in the first step or two; the rest is margin
EXIT_REFUSED = 3  # client_app.cli: stopped for good (banned)


def make_deep_mlp_job() -> Job:
    """Tiles with K = 1024: (256 x 1024) @ (1024 x 1024) forward and for dX."""
    torch.manual_seed(7)
    model = nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 16)
    )
    gen = torch.Generator().manual_seed(8)
    data = [
        (torch.randn(256, 256, generator=gen), torch.randint(0, 16, (256,), generator=gen))
        for _ in range(STEPS)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Job(model=model, loss_fn=F.cross_entropy, optimizer=opt, batches=data, name="deep_mlp")


def ledger_rows(state: Path) -> dict[str, dict[str, Any]]:
    with sqlite3.connect(state / "ledger.sqlite") as db:
        db.row_factory = sqlite3.Row
        return {row["name"]: dict(row) for row in db.execute("SELECT * FROM contributions")}


def slug(cheat: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in cheat).strip("-")


def test_every_cheat_is_rejected_every_time_and_its_key_banned(tmp_path: Path) -> None:
    _cheaters_banned(tmp_path, "e2e.test_e2e_cheaters:make_deep_mlp_job", make_deep_mlp_job, CHEATS)


def test_cheats_on_convolution_tiles_are_rejected_and_banned(tmp_path: Path) -> None:
    """A CNN's tiles carry image blocks that workers unfold; the coordinator checks the
    product over the same patches, so a cheat there is caught like any other."""
    cheats = ["bf16 operands", "scale 1+1e-4", "1 entry +-1e-3 max"]
    _cheaters_banned(tmp_path, "support.real_models:make_cnn_job", make_cnn_job, cheats)


def _cheaters_banned(tmp_path: Path, job: str, make_job: Any, cheats: Any) -> None:
    names = {cheat: f"cheat-{slug(cheat)}" for cheat in cheats}
    # No copies of late tiles: every wrong result must reach its check rather than lose
    # a race to a copy (which would discard it unchecked).
    coord = Coordinator(
        tmp_path,
        "--job",
        job,
        "--steps",
        str(STEPS),
        "--min-workers",
        str(len(cheats) + 1),
        "--speculate-after",
        "0",
    )
    workers = [Worker(tmp_path, coord.url, "honest")]
    for cheat, name in names.items():
        # Window 1: each result is judged before the next tile arrives.
        workers.append(
            Worker(
                tmp_path,
                coord.url,
                name,
                "--window",
                "1",
                program=TESTS / "support" / "cheating_worker.py",
                env={"CLEAVE_CHEAT": cheat, "CLEAVE_CHEAT_LOG": str(tmp_path / f"{name}.tiles")},
            )
        )
    banned: list[dict[str, Any]] = []
    try:

        def all_banned() -> bool:
            try:
                banned[:] = coord.status()["banned"]
            except OSError:
                if coord.proc.poll() is None:
                    return False
                # The run ended between two polls: the ledger keeps the bans.
                rows = ledger_rows(coord.state).values()
                banned[:] = [{"name": r["name"]} for r in rows if r["banned_reason"]]
            return len(banned) == len(cheats)

        wait_until(all_banned, 300, "every cheater's ban in /api/status")
        assert coord.wait(240) == 0, coord.output()
        for worker in workers[1:]:
            assert worker.proc.wait(30) == EXIT_REFUSED, worker.output()
    finally:
        for worker in workers:
            worker.stop()

    records = coord.steps()
    assert_losses_match([r["loss"] for r in records], train_locally(make_job(), STEPS))
    rows = ledger_rows(coord.state)
    assert {b["name"] for b in banned} == set(names.values())
    for cheat, name in names.items():
        verdicts = (tmp_path / f"{name}.tiles").read_text().split()
        cheated, honest = verdicts.count("cheated"), verdicts.count("honest")
        row = rows[name]
        # Every wrong result that reached the coordinator was rejected (a last one may
        # still be on its way when the ban closes the connection), three ban the key.
        assert row["rejected"] == 3 <= cheated <= 4, (cheat, row, verdicts)
        assert row["tiles"] <= honest, (cheat, row, verdicts)  # no credit for a wrong tile
        assert "3 results failed verification" in row["banned_reason"], (cheat, row)
    assert "x its rounding threshold" in coord.output()  # the log says how far off
    assert rows["honest"]["rejected"] == 0 and rows["honest"]["reputation"] == 1.0
    # Nothing credited twice: the ledger holds exactly the tiles the steps used.
    assert sum(row["tiles"] for row in rows.values()) == sum(r["tiles"] for r in records)
