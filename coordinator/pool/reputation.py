"""Worker reputation: a score in [0, 1] that failed checks cut and verified tiles rebuild.

Pure arithmetic, so the ban rule is a table in the tests. A failed Freivalds check
halves the score; each verified tile closes a small part of the gap to 1. An honest
worker never fails a check (the tolerance is calibrated to rounding), so one failure
is already a strong signal; a broken or cheating worker that fails ``3`` checks with
few good tiles between them falls under ``ban_below`` and is banned, by key, for good.
A worker that fails rarely among many good tiles (flaky memory, say) recovers between
failures and is not banned, but each bad tile is still discarded and never credited.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL = 1.0


@dataclass(frozen=True)
class ReputationPolicy:
    penalty: float = 0.5  # multiplies the score on a failed check
    recovery: float = 0.02  # share of the gap to 1 that a verified tile closes
    ban_below: float = 0.2  # 1 -> 0.5 -> 0.25 -> 0.125: three quick failures ban

    def __post_init__(self) -> None:
        if not 0.0 < self.penalty < 1.0 or not 0.0 <= self.recovery <= 1.0:
            raise ValueError("penalty must be in (0, 1) and recovery in [0, 1]")
        if not 0.0 < self.ban_below < 1.0:
            raise ValueError("ban_below must be in (0, 1)")


def after_verified(score: float, policy: ReputationPolicy) -> float:
    return min(FULL, score + policy.recovery * (FULL - score))


def after_failed(score: float, policy: ReputationPolicy) -> float:
    return score * policy.penalty


def is_banned(score: float, policy: ReputationPolicy) -> bool:
    return score < policy.ban_below


def ban_reason(failed_checks: int, score: float) -> str:
    """What operators read in /api/status and the worker reads in its refusal."""
    return (
        f"{failed_checks} results failed verification (reputation {score:.2f}); "
        "its tiles were discarded and re-issued"
    )
