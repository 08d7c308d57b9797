"""Named limits applied to everything that arrives over the network.

A peer that exceeds one gets an error naming the limit, so operators can tell a
misconfiguration (tiles larger than workers accept) from hostile input.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WireLimits:
    max_frame_bytes: int = 512 << 20  # whole WebSocket message
    max_header_bytes: int = 64 << 10  # JSON header of one message
    max_tensors: int = 8  # tensors in one message
    max_ndim: int = 4
    max_dim: int = 1 << 24  # any single dimension
    max_tensor_elements: int = 1 << 27  # 512 MiB of fp32
    max_string_chars: int = 256  # names, ids, codes
    max_message_chars: int = 4096  # free-text error messages
    max_batch_frames: int = 64  # messages joined into one (``common.batches``)

    def __post_init__(self) -> None:
        if self.max_frame_bytes <= self.max_header_bytes:
            raise ValueError("max_frame_bytes must exceed max_header_bytes")


DEFAULT_LIMITS = WireLimits()


def held_tiles_limit(window: int) -> int:
    """The most tiles a worker with this window accepts at once: the coordinator's
    window briefly overshoots (a cancelled tile still computing while its replacement
    arrives), and small tiles share window slots (``SchedulerConfig.slot_flops``)."""
    return max(4 * window, 8)
