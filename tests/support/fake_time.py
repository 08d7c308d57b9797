"""Time the tests move by hand: a clock and sleeps that wait for it, for the worker's
pacing."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from client_app.options import Clocks


class FakeTime:
    """Clocks that move only when told, and waits that pass at once by moving them.

    A wait longer than ``hold_over_s`` is held instead: it ends only when the pacer's
    event is set (a changed limit), and moves no clock. ``waits`` lists every wait asked
    for, in seconds; ``held`` the ones held.
    """

    def __init__(self, hold_over_s: float = math.inf) -> None:
        self.t = 1000.0  # monotonic and perf_counter seconds
        self.cpu = 0.0  # process CPU seconds
        self.hold_over_s = hold_over_s
        self.waits: list[float] = []
        self.held: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def process_time(self) -> float:
        return self.cpu

    def busy(self, wall_s: float, cpu_s: float) -> None:
        """Something took ``wall_s`` seconds and ``cpu_s`` CPU seconds."""
        self.t += wall_s
        self.cpu += cpu_s

    async def wait(self, event: asyncio.Event, timeout_s: float) -> None:
        self.waits.append(timeout_s)
        if timeout_s > self.hold_over_s:
            self.held.append(timeout_s)
            await event.wait()
            return
        self.t += timeout_s  # before yielding: whoever runs next sees the wait passed
        await asyncio.sleep(0)

    def clocks(self) -> Clocks:
        return Clocks(
            monotonic=self.monotonic,
            process_time=self.process_time,
            perf_counter=self.monotonic,
            wait=self.wait,
        )


async def until(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    """Poll ``condition()`` on the loop, for at most ``seconds``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)
