"""A worker outlives its coordinator: it reconnects to a restarted one (same state
directory, so the same key) and keeps its credit in the ledger."""

from __future__ import annotations

import socket
import sqlite3
from pathlib import Path

import pytest
from support.procs import Coordinator, Worker, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_worker_reconnects_to_a_restarted_coordinator(tmp_path: Path) -> None:
    port, state = _free_port(), tmp_path / "shared-state"
    args = ("--port", str(port), "--state-dir", str(state), "--steps", "2")
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = Coordinator(tmp_path / "first", *args)
    worker = Worker(tmp_path, first.url, "steadfast", "--backoff-base", "0.2")
    try:
        assert first.wait(120) == 0, first.output()
        wait_until(
            lambda: "Reconnecting" in worker.output() or "reconnect" in worker.output(),
            30,
            "the worker to notice the coordinator is gone",
        )
        assert worker.proc.poll() is None, worker.output()
        # Two more steps on top of the two checkpointed by the first run.
        second = Coordinator(tmp_path / "second", *args, "--steps", "4")
        assert second.wait(120) == 0, second.output()
    finally:
        worker.stop()
    assert worker.proc.returncode == 0, worker.output()
    tiles = sum(r["tiles"] for r in first.steps()) + sum(r["tiles"] for r in second.steps())
    with sqlite3.connect(state / "ledger.sqlite") as db:
        (credited,) = db.execute(
            "SELECT tiles FROM contributions WHERE name = 'steadfast'"
        ).fetchone()
    assert credited == tiles > 0
    assert "changed" not in worker.output()  # same key both times: the pin held
