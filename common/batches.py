"""Several protocol messages in one WebSocket message.

A small tile's task or result costs its sender and receiver more in per-message work
(websockets' framing, a pass through the event loop) than in bytes. So each side's
writer joins the small frames that are ready to go at once into one ``batch``:

``header {"type": "batch", "v": 4, "frames": [n1, n2, ...]} | payload``

where the payload is the frames themselves, each starting on a ``PAYLOAD_ALIGN``
boundary (zero padding between them), so the tensors inside stay as aligned as in a
frame of their own. Each inner frame is exactly the message it would have been alone
(a task keeps its own signature), and is handled as if it had arrived alone, in order.
A batch holds no batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from common.errors import FrameError, LimitExceeded, ProtocolError
from common.frames import PAYLOAD_ALIGN, Buffer, FrameParts, encode_frame
from common.limits import WireLimits
from common.message_fields import wire_header

if TYPE_CHECKING:
    from common.messages import Received

F = TypeVar("F", bytes, FrameParts, "bytes | FrameParts")

# A frame at least this large is sent on its own: joining copies it, and its own
# WebSocket message costs little beside its bytes.
BATCH_BELOW_BYTES = 128 << 10


@dataclass(frozen=True)
class Batch:
    TYPE: ClassVar[str] = "batch"
    frames: tuple[int, ...]  # each inner frame's length, in order

    def to_header(self) -> dict[str, Any]:
        return {"frames": list(self.frames)}

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Batch:
        sizes = h.get("frames")
        if not isinstance(sizes, list) or not sizes:
            raise ProtocolError('batch: field "frames" must be a non-empty list')
        if len(sizes) > limits.max_batch_frames:
            raise LimitExceeded(
                f"batch of {len(sizes)} frames exceeds max_batch_frames={limits.max_batch_frames}"
            )
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
            raise ProtocolError('batch: field "frames" must hold positive frame lengths')
        return cls(tuple(sizes))


def batch_frame(frames: Iterable[Buffer]) -> bytes:
    """One ``batch`` message holding ``frames`` (each a whole protocol message)."""
    parts: list[Buffer] = []
    sizes: list[int] = []
    end = 0
    for frame in frames:
        if parts and end % PAYLOAD_ALIGN:
            parts.append(bytes(-end % PAYLOAD_ALIGN))
            end += len(parts[-1])
        parts.append(frame)
        sizes.append(memoryview(frame).nbytes)
        end += sizes[-1]
    return encode_frame(wire_header(Batch(tuple(sizes))), parts)


def inner_frames(received: Received) -> list[memoryview]:
    """The frames a received batch holds (views of its payload), after checking that
    they fill it exactly, with only zero padding between them. Raises ``FrameError``:
    a batch that does not add up is not a framing the connection can be trusted with."""
    batch = received.message
    if not isinstance(batch, Batch):
        raise ProtocolError(f"expected a batch, got a {batch.TYPE!r} message")
    payload = received.frame.payload
    out: list[memoryview] = []
    at = 0
    for size in batch.frames:
        start = at + (-at % PAYLOAD_ALIGN) if out else 0
        if any(payload[at:start]):
            raise FrameError("batch has non-zero bytes between its frames")
        if start + size > len(payload):
            raise FrameError(
                f"batch frame of {size} bytes runs past its {len(payload)}-byte payload"
            )
        out.append(payload[start : start + size])
        at = start + size
    if at != len(payload):
        raise FrameError(f"batch has {len(payload) - at} bytes after its last frame")
    return out


def packed(frames: Iterable[F], most: int) -> Iterator[F | bytes]:
    """What to send for ``frames``, in order: runs of frames under ``BATCH_BELOW_BYTES``
    joined into batches of at most ``most`` frames, a run of one and every larger frame
    as it is."""
    run: list[F] = []

    def flush() -> Iterator[F | bytes]:
        if len(run) == 1:
            yield run[0]
        elif run:
            yield batch_frame(f.join() if isinstance(f, FrameParts) else f for f in run)
        run.clear()

    for frame in frames:
        if len(frame) >= BATCH_BELOW_BYTES:
            yield from flush()
            yield frame
            continue
        run.append(frame)
        if len(run) == most:
            yield from flush()
    yield from flush()
