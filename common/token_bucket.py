"""A token bucket with an injected clock: pure logic, for bytes or for messages.

The worker paces its traffic to the owner's bandwidth limit with one
(``client_app.bandwidth``); the coordinator caps each connection's message rate with
another (``coordinator.serve.server``). The bucket runs into debt rather than refusing a
charge bigger than its burst: a frame is indivisible, and the wait after it pays the
debt back, so the long-run rate is the limit whatever the sizes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

BURST_S = 0.25  # without a fixed burst, the bucket holds this many seconds of traffic
MIN_BURST = 16 * 1024  # ... and at least this much, so small frames never wait


class TokenBucket:
    """Allows ``rate`` units per second on average, bursts of up to ``burst`` units.

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
            raise ValueError(f"rate must be >= 0 per second, not {rate}")
        self._refill()
        self._rate = float(rate)
        if self._fixed_burst is not None:
            self._burst = float(self._fixed_burst)
        else:
            self._burst = max(MIN_BURST, self._rate * BURST_S)
        if self._rate == 0.0:
            self._tokens = self._burst  # unlimited: nothing is owed
        else:
            self._tokens = min(self._tokens, self._burst)

    def reserve(self, n: int) -> float:
        """Charge ``n`` units just used; the seconds to wait before using more."""
        if n < 0:
            raise ValueError(f"cannot charge {n} units")
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
