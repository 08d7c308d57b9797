"""Shared test set-up: offscreen Qt, and no test ever touches the user's real config."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import reap_all

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("CLEAVE_CONFIG_DIR", str(tmp_path / "cleave-config"))
    yield


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test() -> Iterator[None]:
    yield
    reap_all()
