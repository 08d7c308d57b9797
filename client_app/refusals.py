"""When a worker stops for good instead of reconnecting, and the key checks behind it.

A refusal (``Actions.refusal``) ends the worker's run: reconnecting would meet the same
answer, so a person must decide (trust a new key, get a join token, ask why banned).
"""

from __future__ import annotations

from collections.abc import Callable

from common.errors import ErrorCode
from common.messages import Welcome

PinCheck = Callable[[str, str], bool]
"""(coordinator URL, key hex) -> True if pinned just now; raises KeyMismatchError."""

# Errors after which reconnecting cannot help: the worker stops and says why.
TERMINAL_ERRORS: dict[str, str] = {
    ErrorCode.BANNED: "this coordinator has banned this worker",
    ErrorCode.BAD_TOKEN: "this coordinator refused the join token",
}

NEEDS_TOKEN = (
    "this coordinator is a private pool: it needs a join token "
    "(cleave-worker --token, or Settings > Join token in the app)"
)


def check_pins(pin_check: PinCheck, url: str, welcome: Welcome) -> bool:
    """Whether ``welcome``'s key was pinned for ``url`` just now. KeyMismatchError if it
    is not the key pinned there, or, for a welcome that sends the worker to another rank
    of the job, not the key pinned for that rank's URL."""
    first_pin = pin_check(url, welcome.coordinator_key)
    if welcome.serve_at:
        pin_check(welcome.serve_at, welcome.coordinator_key)
    return first_pin
