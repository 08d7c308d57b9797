"""Reconnect backoff: capped exponential ceiling, full jitter, reproducible with a seed."""

from __future__ import annotations

import random
import statistics

import pytest

from client_app.backoff import backoff_ceiling, backoff_delay


def test_ceiling_doubles_then_caps() -> None:
    ceilings = [backoff_ceiling(n, base=0.5, cap=30.0) for n in range(10)]
    assert ceilings == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]


def test_delays_stay_within_zero_and_ceiling() -> None:
    rng = random.Random(1)
    for attempt in range(40):
        for _ in range(50):
            delay = backoff_delay(attempt, base=0.25, cap=5.0, rng=rng)
            assert 0.0 <= delay <= min(5.0, 0.25 * 2**attempt)


def test_huge_attempt_counts_stay_capped() -> None:
    assert backoff_delay(10_000, base=1.0, cap=7.0, rng=random.Random(0)) <= 7.0


def test_delays_grow_with_attempts_on_average() -> None:
    rng = random.Random(2)
    means = [
        statistics.fmean(backoff_delay(n, base=0.1, cap=1000.0, rng=rng) for _ in range(400))
        for n in range(6)
    ]
    # Full jitter: the mean is half the ceiling, 0.05 * 2**n, within sampling noise.
    for n, mean in enumerate(means):
        assert mean == pytest.approx(0.05 * 2**n, rel=0.15)
    assert means == sorted(means)


def test_jitter_spreads_delays_and_a_seed_reproduces_them() -> None:
    draws = [backoff_delay(4, rng=random.Random(7)) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]  # same seed, same delay
    rng = random.Random(7)
    spread = {round(backoff_delay(4, rng=rng), 9) for _ in range(100)}
    assert len(spread) > 90  # not a fixed delay: workers must not reconnect in lockstep
    assert min(spread) < 2.0 < max(spread)  # uses the whole [0, 8) range


@pytest.mark.parametrize("kwargs", [{"attempt": -1}, {"attempt": 0, "base": 0.0}])
def test_bad_arguments_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        backoff_delay(rng=random.Random(0), **kwargs)  # type: ignore[arg-type]
