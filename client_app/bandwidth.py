"""The owner's bandwidth limit as a token bucket: pure logic with an injected clock.

The worker asks the bucket after each frame it receives (and before each result it
sends) how long to wait. Not reading the socket for that long lets TCP's own flow
control slow the coordinator down, so no bytes are dropped and the protocol is
unchanged. The bucket runs into debt rather than refusing a frame bigger than its
burst: a tile is indivisible, and the wait after it pays the debt back, so the long-run
rate is the limit whatever the frame sizes.
"""

from __future__ import annotations

from common.token_bucket import TokenBucket

__all__ = ["BYTES_PER_KB", "TokenBucket", "bytes_per_s"]

BYTES_PER_KB = 1024  # "KB/s" in the settings means KiB/s, as most download managers do


def bytes_per_s(kbps: int) -> float:
    """The settings' KB/s as bytes per second; 0 stays 0 (unlimited)."""
    if kbps < 0:
        raise ValueError(f"bandwidth limit must be >= 0 KB/s (0: unlimited), not {kbps}")
    return float(kbps * BYTES_PER_KB)
