"""Reputation arithmetic and the ban rule, as exact tables."""

from __future__ import annotations

import pytest

from coordinator.pool.reputation import (
    ReputationPolicy,
    after_failed,
    after_verified,
    ban_reason,
    is_banned,
)

POLICY = ReputationPolicy()


def run(events: str, policy: ReputationPolicy = POLICY) -> tuple[float, int | None]:
    """Apply a string of events (v: verified, f: failed): the score and when a ban fell."""
    score, banned_at = 1.0, None
    for i, event in enumerate(events):
        score = after_verified(score, policy) if event == "v" else after_failed(score, policy)
        if banned_at is None and is_banned(score, policy):
            banned_at = i
    return score, banned_at


@pytest.mark.parametrize(
    "events, banned_at",
    [
        ("v" * 1000, None),  # honest: never
        ("f", None),  # one failure: a strong signal, not yet a ban
        ("ff", None),
        ("fff", 2),  # three quick failures ban
        ("vvvvfvvvvfvvvvf", 14),  # 1 in 5 wrong: banned on the third
        ("f" + "v" * 40 + "f" + "v" * 40 + "f", None),  # rare failures recover between
    ],
)
def test_ban_rule(events: str, banned_at: int | None) -> None:
    assert run(events)[1] == banned_at


def test_scores_stay_in_range_and_move_the_right_way() -> None:
    assert after_verified(1.0, POLICY) == 1.0
    assert after_verified(0.5, POLICY) == pytest.approx(0.51)
    assert after_failed(1.0, POLICY) == 0.5
    assert run("fff")[0] == pytest.approx(0.125)


def test_policy_is_validated_and_the_reason_says_why() -> None:
    with pytest.raises(ValueError):
        ReputationPolicy(penalty=1.0)
    with pytest.raises(ValueError):
        ReputationPolicy(ban_below=0.0)
    assert ban_reason(3, 0.125) == (
        "3 results failed verification (reputation 0.12); its tiles were discarded and re-issued"
    )
