"""The operator guide's Python runs as written: its job factory trains, and its snippet
that loads the trained model from a checkpoint gets the weights the run trained."""

from __future__ import annotations

import re
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from coordinator.step.job import train_locally
from coordinator.step.trainer import Trainer

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "operator.md"

pytestmark = pytest.mark.timeout(120)


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


def _block(starting: str) -> str:
    found = [b for b in _python_blocks() if b.startswith(starting)]
    assert len(found) == 1, f"one python block of the guide starts with {starting!r}"
    return found[0]


@pytest.fixture
def my_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The guide's ``my_job.py``, with 4 batches instead of 1000, importable."""
    source = _block("# /etc/cleave/jobs/my_job.py")
    assert "for _ in range(1000)" in source
    (tmp_path / "my_job.py").write_text(source.replace("range(1000)", "range(4)"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("my_job", None)


def test_the_trained_model_snippet_loads_what_the_run_trained(my_job: Path) -> None:
    from my_job import make_job  # type: ignore[import-not-found]

    state = my_job / "cleave-state"
    state.mkdir()
    Trainer(make_job(), None, checkpoint_path=state / "checkpoint.pt").run(3)
    reference = make_job()
    train_locally(reference, 3)

    snippet = _block("import torch\nfrom my_job import make_job")
    (my_job / "load_model.py").write_text(snippet)
    runpy.run_path(str(my_job / "load_model.py"))
    shipped = torch.load(my_job / "my-mlp.pt")
    for name, value in reference.model.state_dict().items():
        torch.testing.assert_close(shipped[name], value, rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(shipped[n], v) for n, v in make_job().model.state_dict().items())
