"""Two coordinator ranks on two hosts, for real: each rank in a network namespace of its
own, the ranks' rendezvous and gloo links over a private veth link between them, and
each rank's worker in a third namespace that reaches the ranks' WebSocket addresses
but has no route to their private link. The losses equal local torch on the whole
batch. Ranks that cannot link (gloo on an interface the other host cannot reach) stop
and say which setting links them. Skipped, with the reason, where namespaces cannot be
made."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from support.netns import Hosts
from support.procs import assert_losses_match, env_for, read_steps

from coordinator.jobs.tiny_gpt import make_job
from coordinator.step.job import train_locally

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]
STEPS = 4
PORT = 8765  # each namespace has ports of its own
MASTER_PORT = 29500


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    reason = Hosts.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    made = Hosts()
    try:
        yield made
    finally:
        made.close()


class TwoHosts:
    """Two rank hosts with a private link between them, and a workers' host that reaches
    each rank host's public address only."""

    def __init__(self, hosts: Hosts, tmp: Path) -> None:
        self.hosts, self.tmp = hosts, tmp
        self.h0, self.h1, self.w = hosts.add("rank0"), hosts.add("rank1"), hosts.add("workers")
        self.private = hosts.link(self.h0, "10.77.0.1/24", self.h1, "10.77.0.2/24")
        hosts.link(self.w, "10.77.1.2/24", self.h0, "10.77.1.1/24")
        hosts.link(self.w, "10.77.2.2/24", self.h1, "10.77.2.1/24")
        self.public = {0: "10.77.1.1", 1: "10.77.2.1"}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[str, Path] = {}

    def start_rank(self, rank: int, gloo_interface: bool = True) -> subprocess.Popen[bytes]:
        """The operator's command on host ``rank``, as docs/operator.md gives it: one rank a
        host, gloo on the private link."""
        env = env_for(self.tmp / f"rank{rank}-config")
        if gloo_interface:
            env["GLOO_SOCKET_IFNAME"] = self.private[rank]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        cmd += ["--node-rank", str(rank), "--nproc-per-node", "1"]
        cmd += ["--master-addr", "10.77.0.1", "--master-port", str(MASTER_PORT)]
        cmd += ["-m", "coordinator", "serve", "--host", self.public[rank], "--port", str(PORT)]
        cmd += ["--state-dir", str(self.tmp / "state")]
        cmd += ["--metrics-out", str(self.tmp / f"metrics-{rank}.jsonl")]
        cmd += ["--planner", "grid", "--steps", str(STEPS), "--min-workers", "1"]
        return self._start((self.h0, self.h1)[rank], cmd, env, f"rank{rank}")

    def start_worker(self, rank: int) -> subprocess.Popen[bytes]:
        url = f"ws://{self.public[rank]}:{PORT + rank}/ws"  # rank r listens on PORT + r
        cmd = [sys.executable, "-m", "client_app", "--coordinator", url]
        cmd += ["--name", f"worker-{rank}", "--threads", "1"]
        return self._start(self.w, cmd, env_for(self.tmp / f"worker{rank}-config"), f"worker{rank}")

    def _start(
        self, ns: str, cmd: list[str], env: dict[str, str], name: str
    ) -> subprocess.Popen[bytes]:
        self.logs[name] = self.tmp / f"{name}.log"
        with self.logs[name].open("wb") as fh:
            proc = subprocess.Popen(
                self.hosts.run_in(ns, cmd), env=env, stdout=fh, stderr=subprocess.STDOUT
            )
        self.procs.append(proc)
        return proc

    @staticmethod
    def wait(proc: subprocess.Popen[bytes], timeout: float = 300) -> int | None:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def output(self) -> str:
        return "\n".join(f"--- {name}\n{path.read_text()}" for name, path in self.logs.items())

    def close(self) -> None:
        """Kill what is left, ranks included: a rank outlives its torchrun (and a torchrun
        whose master went away leaves it behind), so they are found by this test's
        directory in their command lines."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for left in psutil.process_iter(["cmdline"]):
            if any(str(self.tmp) in arg for arg in left.info["cmdline"] or ()):
                with contextlib.suppress(psutil.Error):
                    left.kill()


@pytest.fixture
def two_hosts(hosts: Hosts, tmp_path: Path) -> Iterator[TwoHosts]:
    made = TwoHosts(hosts, tmp_path)
    try:
        yield made
    finally:
        made.close()


def test_two_ranks_on_two_hosts_train_like_local_torch(two_hosts: TwoHosts) -> None:
    ranks = [two_hosts.start_rank(rank) for rank in (0, 1)]
    for rank in (0, 1):
        two_hosts.start_worker(rank)

    # The workers' host reaches each rank's WebSocket address, not the ranks' link.
    probe = "import socket; socket.create_connection(('10.77.0.1', %d), timeout=5)"
    unreachable = subprocess.run(
        two_hosts.hosts.run_in(two_hosts.w, [sys.executable, "-c", probe % MASTER_PORT]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unreachable.returncode != 0, "the workers' host reached the ranks' private link"
    assert "unreachable" in unreachable.stderr.lower(), unreachable.stderr

    assert [two_hosts.wait(proc) for proc in ranks] == [0, 0], two_hosts.output()
    out = two_hosts.output()
    for rank in (0, 1):
        assert f"worker worker-{rank} [" in two_hosts.logs[f"rank{rank}"].read_text(), out
    records = read_steps(two_hosts.tmp / "metrics-0.jsonl")
    assert len(records) == STEPS and all(r["tiles"] > 0 for r in records), out
    assert_losses_match([r["loss"] for r in records], train_locally(make_job(), STEPS))


def test_ranks_that_cannot_link_stop_and_say_which_setting_links_them(
    two_hosts: TwoHosts,
) -> None:
    # Without GLOO_SOCKET_IFNAME, gloo here falls back to loopback, which the other
    # host cannot reach.
    ranks = [two_hosts.start_rank(rank, gloo_interface=False) for rank in (0, 1)]
    # The rank that dials stops; the one it could not reach waits for it until the
    # ranks' timeout (torchrun's static rendezvous does not tell it), and is killed here.
    deadline = time.monotonic() + 120
    while all(proc.poll() is None for proc in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    out = two_hosts.output()
    assert any(proc.poll() not in (0, None) for proc in ranks), out
    assert "the coordinator ranks could not link" in out, out
    assert "set it on every host to the interface of the link" in out, out
