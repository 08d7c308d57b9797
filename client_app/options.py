"""How a ``WorkerCore`` runs, beyond the owner's settings: one validated options value.

``WorkerSettings`` (``client_app.config``) holds what the owner chooses and saves;
``WorkerOptions`` holds what the program around the core decides: its identity and
client name, the CA file for wss://, reconnect and log pacing, and the parts tests
replace (a fixed device profile, a tile computer, a seeded RNG, and every clock). A bad
value is a ValueError when the options are made, not a misbehaving worker later.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client_app.compute import TileComputer
from common.limits import DEFAULT_LIMITS
from common.messages import DeviceProfile

Wait = Callable[[asyncio.Event, float], Awaitable[None]]
"""(event, seconds) -> returns once the event is set or the seconds have passed."""


async def wait_for_event(event: asyncio.Event, timeout_s: float) -> None:
    """The real ``Wait``: on the event loop, so everything else keeps running meanwhile."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)


@dataclass(frozen=True)
class Clocks:
    """Every time source the worker's limits read, so that tests can pace it exactly.

    ``monotonic`` times the session (heartbeats), the rests and the bandwidth buckets;
    ``process_time`` is the CPU time a tile is charged; ``perf_counter`` times a GEMM
    (finer than ``monotonic`` on Windows); ``wait`` is how rests and bandwidth waits pass.
    """

    monotonic: Callable[[], float] = time.monotonic
    process_time: Callable[[], float] = time.process_time
    perf_counter: Callable[[], float] = time.perf_counter
    wait: Wait = wait_for_event


@dataclass(frozen=True)
class WorkerOptions:
    """Everything a ``WorkerCore`` takes besides the owner's settings and the pin check."""

    # The CLI and the app pass the key kept in the config directory; None (embedded
    # use, tests): a new identity for this run only.
    identity: Ed25519PrivateKey | None = None
    client_name: str = "cleave-worker"  # sent in Hello: which program this is
    ca_file: str | None = None  # wss:// only: also trust the certificates in this PEM
    profile: DeviceProfile | None = None  # None: measured on the compute thread at start
    computer: TileComputer | None = None  # None: one for the settings' threads and GPU
    max_frame_bytes: int = DEFAULT_LIMITS.max_frame_bytes
    welcome_timeout_s: float = 30.0  # a coordinator silent for this long is dropped
    backoff_base_s: float = 0.5  # reconnect delays: see client_app.backoff
    backoff_cap_s: float = 30.0
    rng: random.Random = field(default_factory=random.Random)  # the backoff's jitter
    summary_every: int = 10  # a progress line in the log after this many tiles...
    summary_min_interval_s: float = 10.0  # ... and at most one per this many seconds
    clocks: Clocks = field(default_factory=Clocks)

    def __post_init__(self) -> None:
        if not self.client_name:
            raise ValueError("client_name must not be empty")
        positive = {
            "max_frame_bytes": self.max_frame_bytes,
            "welcome_timeout_s": self.welcome_timeout_s,
            "backoff_base_s": self.backoff_base_s,
            "backoff_cap_s": self.backoff_cap_s,
            "summary_every": self.summary_every,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, not {value}")
        if self.summary_min_interval_s < 0:
            raise ValueError(
                f"summary_min_interval_s must be >= 0, not {self.summary_min_interval_s}"
            )


def tls_context(url: str, ca_file: str | None) -> ssl.SSLContext | None:
    """The TLS context for ``url`` (None for ws://); ValueError for a URL or CA file
    that cannot work.

    For wss:// the coordinator's certificate is checked against the system store plus
    (or, for a self-signed coordinator, in practice instead of it) the CA file.
    """
    if not url.startswith(("ws://", "wss://")):
        raise ValueError(f"coordinator URL must start with ws:// or wss://, not {url!r}")
    if not url.startswith("wss://"):
        if ca_file is not None:
            raise ValueError("a CA file applies only to wss:// coordinator URLs")
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load CA file {ca_file!r}: {exc}") from None
