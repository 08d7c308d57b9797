"""The owner's CPU-time and bandwidth limits, applied by waiting on the event loop.

``Pacer`` holds the duty cycle (``client_app.duty``) and one token bucket per direction
(``client_app.bandwidth``) and turns their answers into waits: a rest after each tile,
a wait after each received frame (not reading the socket lets TCP slow the sender) and
before each result is sent. Every wait is an injected ``Wait`` on the event loop, so
heartbeats, cancels and prefetched tiles keep flowing meanwhile, a stop cancels it, and
tests pass a fake clock and wait and get exact figures.

Threads: the ``request_*`` methods validate and store a new limit from any thread (an
int store is atomic); the owner's event loop then calls the matching ``*_changed``,
which alone touches the controllers and wakes a wait under way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from client_app.bandwidth import TokenBucket, bytes_per_s
from client_app.duty import DutyCycle, fraction_from_percent
from client_app.options import Wait, wait_for_event


class Pacer:
    """Rests between tiles and waits around frames, as the owner's limits ask."""

    def __init__(
        self,
        cpu_percent: int,
        bandwidth_kbps: int,
        *,
        clock: Callable[[], float],
        wait: Wait = wait_for_event,
        on_rest: Callable[[], None] = lambda: None,
    ) -> None:
        self._clock = clock
        self._wait = wait
        self._on_rest = on_rest  # called when a rest starts and when it ends
        self._cpu_percent = cpu_percent
        self._duty = DutyCycle(fraction_from_percent(cpu_percent))
        self._bandwidth_kbps = bandwidth_kbps
        self._down = TokenBucket(bytes_per_s(bandwidth_kbps), clock=clock)
        self._up = TokenBucket(bytes_per_s(bandwidth_kbps), clock=clock)
        self.resting = False
        self._duty_changed: asyncio.Event | None = None
        self._bandwidth_changed: asyncio.Event | None = None

    @property
    def cpu_percent(self) -> int:
        return self._cpu_percent

    @property
    def bandwidth_kbps(self) -> int:
        return self._bandwidth_kbps

    def start(self) -> None:
        """Bind to the running event loop; a limit set before this counts from here."""
        # Events are made here, not in __init__: they belong to the loop that runs us.
        self._duty_changed = asyncio.Event()
        self._bandwidth_changed = asyncio.Event()
        self.bandwidth_changed()

    # ---- changing the limits ---------------------------------------------------------

    def request_cpu_percent(self, percent: int) -> None:
        """Store a new CPU-time limit (1..100); ValueError in the caller's thread."""
        fraction_from_percent(percent)
        self._cpu_percent = percent

    def cpu_percent_changed(self) -> None:
        """On the loop: a rest under way ends at once if the limit was raised, and runs
        its course if it was lowered; the next rest obeys the new limit."""
        if self._duty_changed is not None:
            self._duty_changed.set()

    def request_bandwidth_kbps(self, kbps: int) -> None:
        """Store a new bandwidth limit (KiB/s each way, 0: unlimited); ValueError here."""
        bytes_per_s(kbps)
        self._bandwidth_kbps = kbps

    def bandwidth_changed(self) -> None:
        """On the loop: a wait under way is recomputed at the new rate (and ends at once
        when unlimited)."""
        rate = bytes_per_s(self._bandwidth_kbps)
        self._down.set_rate(rate)
        self._up.set_rate(rate)
        if self._bandwidth_changed is not None:
            self._bandwidth_changed.set()

    # ---- waiting ---------------------------------------------------------------------

    async def after_receiving(self, n: int) -> None:
        """Charge a received frame of ``n`` bytes and wait until more may be read."""
        await self._throttle(self._down, n)

    async def before_sending(self, n: int) -> None:
        """Charge a frame of ``n`` bytes about to be sent and wait until it may go."""
        await self._throttle(self._up, n)

    async def _throttle(self, bucket: TokenBucket, n: int) -> None:
        changed = self._bandwidth_changed
        assert changed is not None, "Pacer.start() first"
        wait_s = bucket.reserve(n)
        while wait_s > 0.0:
            changed.clear()
            await self._wait(changed, wait_s)
            wait_s = bucket.wait_s()

    async def rest_after_tile(self, start: float, end: float, cost: float) -> None:
        """Rest after a tile that ran over [start, end] and cost ``cost`` busy seconds,
        as long as the CPU-time limit asks (no rest at 100%)."""
        changed = self._duty_changed
        assert changed is not None, "Pacer.start() first"
        self._duty.set_fraction(self._cpu_percent / 100.0)
        rest_s = self._duty.unit_done(start, end, cost)
        if rest_s <= 0.0:
            return
        deadline = self._clock() + rest_s
        percent = self._cpu_percent
        self.resting = True
        self._on_rest()
        try:
            while (left := deadline - self._clock()) > 0:
                changed.clear()
                await self._wait(changed, left)
                if self._cpu_percent > percent:
                    break  # a raised limit owes no more of the rest the old one asked
                percent = self._cpu_percent
        finally:
            self.resting = False
            self._on_rest()
