"""The torch-native entry point: the operator guide's example (docs/operator.md) of a
user's own training loop (docs/examples/own_training_loop.py) run as a user would, a
coordinator inside the script and two real local worker processes; each step's loss
equals the same loop in plain torch, and the workers computed the step's FLOPs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.procs import ROOT, env_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
EXAMPLE = ROOT / "docs" / "examples" / "own_training_loop.py"


def _run(script: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``script`` run as a user would, from ``tmp_path``; it must succeed."""
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env_for(tmp_path / "config"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_own_training_loop_example(tmp_path: Path) -> None:
    done = _run(EXAMPLE, tmp_path)
    steps = re.findall(
        r"step (\d+)  loss ([\d.]+)  plain torch ([\d.]+)  workers computed ([\d.]+)%",
        done.stdout,
    )
    assert len(steps) == 5, done.stdout
    for _, ours, plain, share in steps:
        assert abs(float(ours) - float(plain)) <= 1e-5 * float(plain), done.stdout
        assert float(share) >= 99.0, done.stdout


LSTM_SCRIPT = """
import tempfile
import torch, torch.nn.functional as F
from torch import nn
from coordinator import Pool

torch.manual_seed(0)
emb, rnn, head = nn.Embedding(50, 64), nn.LSTM(64, 128, batch_first=True), nn.Linear(128, 50)
def forward(x):
    return head(rnn(emb(x))[0]).flatten(0, 1)
tokens = torch.randint(0, 50, (8, 33))
x, y = tokens[:, :-1], tokens[:, 1:].flatten()
plain = F.cross_entropy(forward(x), y).item()
with tempfile.TemporaryDirectory() as state, Pool(local_workers=2, state_dir=state) as pool:
    pool.wait_for_workers(2, timeout=120)
    for step in range(2):
        with pool.offload():
            loss = F.cross_entropy(forward(x), y)
            loss.backward()
        print(f"step {step} loss {loss.item():.7f} plain {plain:.7f} "
              f"share {pool.last_step.workers_share:.4f}", flush=True)
"""


def test_a_step_kept_mostly_here_is_said_once_with_what_to_change(tmp_path: Path) -> None:
    """An LSTM runs as fused oneDNN layers the pool cannot cut: the user's log says so,
    once, with the op, its share and how to change it; the loss is plain torch's."""
    script = tmp_path / "lstm_step.py"
    script.write_text(LSTM_SCRIPT)
    done = _run(script, tmp_path)
    steps = re.findall(r"step \d loss ([\d.]+) plain ([\d.]+) share ([\d.]+)", done.stdout)
    assert len(steps) == 2, done.stdout
    for ours, plain, share in steps:
        assert abs(float(ours) - float(plain)) <= 1e-5 * float(plain), done.stdout
        assert float(share) < 0.5, done.stdout
    warnings = [line for line in done.stderr.splitlines() if "mkldnn_rnn_layer" in line]
    assert len(warnings) == 1, done.stderr
    assert "workers computed" in warnings[0] and "mkldnn.flags(enabled=False)" in warnings[0]
