"""Separate hosts on one machine for a test: Linux network namespaces joined by veth
links, each namespace a network stack of its own (interfaces, addresses, ports).

Made with iproute2's ``ip`` and removed when the test ends; needs the rights to make
namespaces (root or CAP_SYS_ADMIN), which ``Hosts.skip_reason`` checks first.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess


class Hosts:
    """Namespaces named for this process, so that two test runs on one machine never
    meet, and the veth links between them."""

    _links = itertools.count()

    def __init__(self) -> None:
        self.tag = f"cl{os.getpid()}"
        self.names: list[str] = []

    @staticmethod
    def skip_reason() -> str | None:
        """Why namespaces cannot be made here, or None if they can."""
        if shutil.which("ip") is None:
            return "iproute2's ip is not installed"
        probe = f"clprobe{os.getpid()}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            return f"cannot make a network namespace: {made.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    def add(self, name: str) -> str:
        ns = f"{self.tag}-{name}"
        _ip("netns", "add", ns)
        self.names.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def link(self, a: str, a_addr: str, b: str, b_addr: str) -> tuple[str, str]:
        """A veth link between namespaces ``a`` and ``b``, addressed ``a_addr`` and
        ``b_addr`` (CIDR); the names of its two ends."""
        n = next(self._links)
        end_a, end_b = f"v{n}a{os.getpid()}"[:15], f"v{n}b{os.getpid()}"[:15]
        _ip("link", "add", end_a, "netns", a, "type", "veth", "peer", "name", end_b, "netns", b)
        for ns, end, addr in ((a, end_a, a_addr), (b, end_b, b_addr)):
            _ip("-n", ns, "addr", "add", addr, "dev", end)
            _ip("-n", ns, "link", "set", end, "up")
        return end_a, end_b

    def run_in(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        """Remove the namespaces (and with them their ends of every link)."""
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.names.clear()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
