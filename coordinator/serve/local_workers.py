"""``--local-workers K``: worker subprocesses started by the coordinator for demos and tests.

Each runs the real ``cleave-worker`` code over a real loopback connection, with its own
config directory under the state directory (so it never touches the user's own pins)
and its log in a file beside it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("cleave.coordinator")


# prctl, looked up once here: a child between fork and exec must not load anything (a
# thread of the parent may have held the loader's lock at the fork).
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """Run in a child before it starts: the child gets SIGTERM when this process dies,
    even by SIGKILL (Linux), so no local worker or rank outlives the process that
    started it."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalWorkers:
    def __init__(
        self,
        count: int,
        url: str,
        state_dir: Path,
        threads: int | None = None,
        ca_file: Path | None = None,
    ) -> None:
        self.count = count
        self.url = url
        self.ca_file = ca_file  # wss://: the coordinator's own certificate, to trust it
        self.dir = state_dir / "local-workers"
        self.threads = threads or max(1, (os.cpu_count() or 2) // max(1, count))
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        for i in range(self.count):
            config_dir = self.dir / f"worker-{i}"
            config_dir.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "CLEAVE_CONFIG_DIR": str(config_dir)}
            cmd = [
                sys.executable,
                "-m",
                "client_app",
                "--coordinator",
                self.url,
                "--name",
                f"local-{i}",
                "--threads",
                str(self.threads),
            ]
            if self.ca_file is not None:
                cmd += ["--ca-file", str(self.ca_file)]
            logfile = (self.dir / f"worker-{i}.log").open("ab")
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=logfile,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=die_with_parent,
                )
            )
            logfile.close()
        log.info(
            "started %d local worker%s (%d thread%s each); logs in %s",
            self.count,
            "" if self.count == 1 else "s",
            self.threads,
            "" if self.threads == 1 else "s",
            self.dir,
        )

    def all_exited(self) -> bool:
        return bool(self.procs) and all(proc.poll() is not None for proc in self.procs)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask each worker to leave (SIGINT: it says bye), then kill stragglers."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
