"""The owner's bandwidth limit as a token bucket: pure logic with an injected clock.

The worker asks the bucket after each frame it receives (and before each result it
sends) how long to wait. Not reading the socket for that long lets TCP's own flow
control slow the coordinator down, so no bytes are dropped and the protocol is
unchanged. The bucket runs into debt rather than refusing a frame bigger than its
burst: a tile is indivisible, and the wait after it pays the debt back, so the long-run
rate is the limit whatever the frame sizes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

BYTES_PER_KB = 1024  # "KB/s" in the settings means KiB/s, as most download managers do
BURST_S = 0.25  # the bucket holds this many seconds of traffic: short bursts pass at once
MIN_BURST_BYTES = 16 * BYTES_PER_KB  # so that small messages never wait at low limits


def bytes_per_s(kbps: int) -> float:
    """The settings' KB/s as bytes per second; 0 stays 0 (unlimited)."""
    if kbps < 0:
        raise ValueError(f"bandwidth limit must be >= 0 KB/s (0: unlimited), not {kbps}")
    return float(kbps * BYTES_PER_KB)


class TokenBucket:
    """Allows ``rate`` bytes per second on average, bursts of up to ``burst`` bytes.

    ``rate`` 0 means unlimited: every wait is 0 and any debt is forgiven.
    """

    def __init__(
        self,
        rate: float,
        burst: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._rate = 0.0
        self._burst = 0.0
        self._tokens = 0.0
        self._fixed_burst = burst
        self._last = clock()
        self.set_rate(rate)
        self._tokens = self._burst  # start full: the first frame is not delayed

    @property
    def rate(self) -> float:
        return self._rate

    @property
    def burst(self) -> float:
        return self._burst

    def set_rate(self, rate: float) -> None:
        """Change the limit from now on; tokens earned so far were earned at the old rate."""
        if rate < 0:
            raise ValueError(f"rate must be >= 0 bytes/s, not {rate}")
        self._refill()
        self._rate = float(rate)
        if self._fixed_burst is not None:
            self._burst = float(self._fixed_burst)
        else:
            self._burst = max(MIN_BURST_BYTES, self._rate * BURST_S)
        if self._rate == 0.0:
            self._tokens = self._burst  # unlimited: nothing is owed
        else:
            self._tokens = min(self._tokens, self._burst)

    def reserve(self, n: int) -> float:
        """Charge ``n`` bytes just moved; the seconds to wait before moving more."""
        if n < 0:
            raise ValueError(f"cannot charge {n} bytes")
        if self._rate == 0.0:
            return 0.0
        self._refill()
        self._tokens -= n
        return self.wait_s()

    def wait_s(self) -> float:
        """Seconds until the debt is paid off at the current rate (0 if none)."""
        if self._rate == 0.0:
            return 0.0
        self._refill()
        return max(0.0, -self._tokens / self._rate)

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._last)  # a clock that steps back earns nothing
        self._last = now
        if self._rate > 0.0:
            self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
