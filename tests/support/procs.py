"""Helpers for end-to-end tests: real coordinator and worker processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
# Every process a test starts, so that one failing half-way never leaves a coordinator
# or worker running into the next test (conftest reaps them after each test).
_STARTED: list[subprocess.Popen[bytes]] = []


def reap_all() -> None:
    """Kill whatever a test started and left running."""
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def env_for(config_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    if config_dir is not None:
        env["CLEAVE_CONFIG_DIR"] = str(config_dir)
    return env


def read_steps(metrics: Path) -> list[dict[str, Any]]:
    """The step records in a ``--metrics-out`` file so far."""
    if not metrics.exists():
        return []
    # Only whole lines: the coordinator may be writing the next one as this reads.
    lines = metrics.read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines if line]


class Coordinator:
    """``python -m coordinator serve ...`` with its output captured to a file."""

    def __init__(self, tmp: Path, *args: str) -> None:
        # These tests are about failures, trust and restarts in GEMMs of several tiles each;
        # the cost model may send a small GEMM whole or keep it here, so it is opted into
        # by the tests of the planner itself (test_e2e_planner.py).
        if "--planner" not in args:
            args = ("--planner", "grid", *args)
        self.state = tmp / "state"
        self.metrics = tmp / "metrics.jsonl"
        self.log = tmp / "coordinator.log"
        cmd = [
            sys.executable,
            "-m",
            "coordinator",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--state-dir",
            str(self.state),
            "--metrics-out",
            str(self.metrics),
            *args,
        ]
        self._logfh = self.log.open("wb")
        self.proc = subprocess.Popen(
            cmd,
            cwd=tmp,
            env=env_for(tmp / "coord-config"),
            stdout=self._logfh,
            stderr=subprocess.STDOUT,
        )
        _STARTED.append(self.proc)
        self.url = self._wait_for(r"on (wss?://127\.0\.0\.1:\d+/ws)", 60)
        self.http = re.sub(r"^ws", "http", self.url).removesuffix("/ws")

    def _wait_for(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.output())
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise AssertionError(f"coordinator exited early:\n{self.output()}")
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {pattern!r}:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def status(self, context: ssl.SSLContext | None = None) -> dict[str, Any]:
        # A generous timeout: a loaded machine can keep the coordinator's loop from
        # answering for seconds (a checkpoint, a big step), and a timeout fails a test.
        with urllib.request.urlopen(self.http + "/api/status", timeout=30, context=context) as resp:
            return json.load(resp)

    def steps(self) -> list[dict[str, Any]]:
        return read_steps(self.metrics)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"coordinator did not finish in {timeout} s:\n{self.output()}"
            ) from None
        finally:
            self._logfh.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM (it checkpoints and leaves cleanly), then kill if it is still there."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.wait(timeout)
        finally:
            self.kill()


class Worker:
    """``cleave-worker`` (or ``program``, a script taking the same arguments) in its own
    config directory, so its key and pins survive a restart under the same ``name``."""

    def __init__(
        self,
        tmp: Path,
        url: str,
        name: str,
        *args: str,
        program: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log = tmp / f"{name}.log"
        self._logfh = self.log.open("ab")  # a restarted worker appends to its log
        entry = ["-m", "client_app"] if program is None else [str(program)]
        cmd = [
            sys.executable,
            *entry,
            "--coordinator",
            url,
            "--name",
            name,
            "--threads",
            "1",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            env={**env_for(tmp / f"{name}-config"), **(env or {})},
            stdout=self._logfh,
            stderr=subprocess.STDOUT,
        )
        _STARTED.append(self.proc)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no Bye, no clean close; the coordinator finds out by itself."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._logfh.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._logfh.close()


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def assert_losses_match(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(want), (got, want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rel * abs(w), f"step {step}: distributed {g!r} vs local {w!r}"
