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


def test_own_training_loop_example(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        cwd=tmp_path,
        env=env_for(tmp_path / "config"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steps = re.findall(
        r"step (\d+)  loss ([\d.]+)  plain torch ([\d.]+)  workers computed ([\d.]+)%",
        done.stdout,
    )
    assert len(steps) == 5, done.stdout
    for _, ours, plain, share in steps:
        assert abs(float(ours) - float(plain)) <= 1e-5 * float(plain), done.stdout
        assert float(share) >= 99.0, done.stdout
