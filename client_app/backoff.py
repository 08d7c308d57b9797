"""Reconnect delays: capped exponential backoff with full jitter.

Full jitter (a uniform draw below the exponential ceiling) spreads the reconnects of
many workers that lost the same coordinator at the same moment, so a restarted
coordinator is not hit by all of them in the same instant.
"""

from __future__ import annotations

import random

# 2**64 * base overflows no float, but keeps the exponent bounded for huge attempt counts.
_MAX_EXPONENT = 64


def backoff_ceiling(attempt: int, *, base: float = 0.5, cap: float = 30.0) -> float:
    """The largest delay ``backoff_delay`` may return for this attempt."""
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, not {attempt}")
    if base <= 0 or cap <= 0:
        raise ValueError(f"base and cap must be positive, not {base} and {cap}")
    return min(cap, base * 2.0 ** min(attempt, _MAX_EXPONENT))


def backoff_delay(
    attempt: int, *, base: float = 0.5, cap: float = 30.0, rng: random.Random
) -> float:
    """Seconds to wait before reconnect attempt ``attempt`` (0 for the first retry)."""
    return rng.uniform(0.0, backoff_ceiling(attempt, base=base, cap=cap))
