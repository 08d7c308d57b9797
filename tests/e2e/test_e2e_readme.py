"""The README's quick start as a newcomer runs it: `make demo` trains, and what it prints
has every line the README shows (numbers, ports, keys and paths aside)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_sample() -> list[str]:
    """The lines of the README's block of `make demo` output (the fenced block after the
    quick start's commands), without the '...' that stands for the steps left out."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    commands = next(i for i, block in enumerate(blocks) if block.startswith("make demo"))
    sample = blocks[commands + 1].splitlines()
    return [line for line in sample if line.strip() and line.strip() != "..."]


def shape(line: str) -> re.Pattern[str]:
    """A pattern for the lines like ``line``: any fingerprint, number, port or path where
    it has one, and any run of spaces where it has a run (columns move with the widths)."""
    out = []
    for token in re.split(r"(\s+)", line.strip()):
        if not token:
            continue
        if token.isspace():
            out.append(r"\s+")
        elif re.fullmatch(r"[0-9a-f]{4}(-[0-9a-f]{4})+", token):
            out.append(r"[0-9a-f]{4}(?:-[0-9a-f]{4})+")
        else:
            pattern = re.escape(token)
            pattern = re.sub(r"\d+(?:\\\.\d+)?", r"\\d+(?:\\.\\d+)?", pattern)
            # The state directory is the test's own.
            pattern = pattern.replace(re.escape("cleave-state/"), r"\S*/")
            out.append(pattern)
    return re.compile("".join(out))


def test_the_readme_sample_pattern_matches_only_lines_of_its_shape() -> None:
    step = shape("step   29  loss 2.6705    0.68 s  tiles   88  reissued   0  workers 2")
    assert step.fullmatch("step    2  loss 3.4976    0.42 s  tiles   63  reissued   0  workers 2")
    assert not step.fullmatch("step    2  loss 3.4976    0.42 s  tiles   63  workers 2")
    checkpoint = shape("checkpoint: step 30 in cleave-state/checkpoint.pt")
    assert checkpoint.fullmatch("checkpoint: step 3 in /tmp/x/state/checkpoint.pt")


@pytest.mark.timeout(600)
def test_make_demo_prints_what_the_readme_shows(tmp_path: Path) -> None:
    venv = Path(sys.prefix)
    if not (venv / ".cleave-installed").exists():
        pytest.skip(f"{venv} was not made by `make setup`, so `make demo` would make one")
    proc = subprocess.run(
        ["make", "demo", "STEPS=3", f"STATE_DIR={tmp_path / 'state'}", f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    lines = [line.strip() for line in output.splitlines()]
    missing = [s for s in readme_sample() if not any(shape(s).fullmatch(line) for line in lines)]
    assert not missing, f"the README shows lines `make demo` no longer prints: {missing}\n{output}"
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 3, output
    assert (tmp_path / "state" / "checkpoint.pt").exists()
