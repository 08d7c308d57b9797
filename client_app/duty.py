"""The owner's CPU-time limit as a duty cycle: how long to rest after each tile.

A GEMM cannot be paused halfway, so the worker keeps to "p of the CPU time" the only way
it can: it runs whole tiles and rests between them. After each tile ``DutyCycle`` says
how long to rest so that, over a sliding window, the compute cost divided by the elapsed
time (tiles, rests and any idle gaps together) comes back to p.

What a tile costs is the caller's to measure; the worker passes the process's CPU time
during the GEMM divided by its thread cap (see ``client_app.charging``), so that "50%"
means half of the cores the owner granted, whatever contention stretches the GEMM's
wall time.

Pure logic: every time is passed in, so tests need no clock and no sleeping.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

DEFAULT_WINDOW_S = 10.0


class _Unit(NamedTuple):
    start: float
    end: float
    cost: float


class DutyCycle:
    """Rest times that hold compute cost / elapsed time at ``fraction`` over a window.

    Settling debt over a window (rather than resting exactly ``cost·(1-p)/p`` after
    each tile) corrects itself: a rest that overslept, or a wait for the next tile,
    counts as rest already taken and shortens the next one. The window bounds that
    memory, so hours of idling do not buy a burst at full speed.
    """

    def __init__(self, fraction: float = 1.0, *, window_s: float = DEFAULT_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, not {window_s}")
        self.window_s = window_s
        self._fraction = _checked(fraction)
        self._units: deque[_Unit] = deque()

    @property
    def fraction(self) -> float:
        return self._fraction

    def set_fraction(self, fraction: float) -> None:
        """Change the target; it governs the rest after the next finished tile.

        The history is dropped: debt run up at 100% must not become a long rest the
        moment the owner lowers the limit, nor credit saved at 10% a burst at 90%.
        """
        fraction = _checked(fraction)
        if fraction != self._fraction:
            self._fraction = fraction
            self._units.clear()

    def unit_done(self, start: float, end: float, cost: float) -> float:
        """Seconds to rest after a unit that ran over [start, end] and cost ``cost``.

        ``cost`` is in the same unit as the window (busy seconds at the thread cap);
        it may differ from ``end - start``: less when other programs slowed the GEMM,
        more when the worker's own threads were busy around it.
        """
        if end < start:
            raise ValueError(f"a unit cannot end ({end}) before it starts ({start})")
        if self._fraction >= 1.0:
            return 0.0  # no limit: nothing to remember either
        self._units.append(_Unit(start, end, max(0.0, cost)))
        # Forget units that ended more than a window ago; the newest always stays.
        while len(self._units) > 1 and self._units[0].end < end - self.window_s:
            self._units.popleft()
        total = sum(unit.cost for unit in self._units)
        # Earliest moment at which total / (moment - window start) falls back to p.
        ready_at = self._units[0].start + total / self._fraction
        return max(0.0, ready_at - end)


def fraction_from_percent(percent: int) -> float:
    """The owner's whole percent (1..100) as a fraction; anything else is a ValueError."""
    if isinstance(percent, bool) or not isinstance(percent, int) or not 1 <= percent <= 100:
        raise ValueError(f"CPU percent must be a whole number in [1, 100], not {percent!r}")
    return percent / 100.0


def _checked(fraction: float) -> float:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"duty-cycle fraction must be in (0, 1], not {fraction}")
    return float(fraction)
