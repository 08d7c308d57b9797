"""Writing a WebSocket connection's large frames from the buffers they are made of, for
websockets' asyncio connections on either end (``FrameWrites``).

websockets serializes every frame into new bytes: the payload masked into one copy (a
client's), then written behind its header into another. ``FrameWrites`` writes a data
frame of ``WRITE_DIRECT_FROM`` bytes or more as its header and then its payload: a
server's as it lies (its frames are never masked, RFC 6455 §5.1), a client's masked part
by part into one copy, which masking needs anyway. A message held as its parts
(``common.frames.FrameParts``: a task's head and the operand blocks it shares with
other tasks, a result's head and its tile) goes out as one frame, its parts written one
after another; as fragments of one message, each part would be a frame of its own, and
the receiver would join them into one more copy. One under ``JOIN_PARTS_BELOW`` bytes is
joined first: each part would be a write of its own (a system call and a pass through
the transport), which costs more than copying that many bytes. Smaller frames, and
frames an extension would transform, take websockets' own path.

The transport may hold on to a payload (TLS encrypts it later), so what is sent must not
change once handed over: operand blocks are never written after they are cut, a result
is not touched once encoded, and headers and batches are new bytes.
"""

from __future__ import annotations

import asyncio
import secrets
import struct
from collections.abc import Sequence
from typing import Any

from websockets.client import ClientProtocol
from websockets.frames import Frame
from websockets.protocol import Protocol, Side
from websockets.server import ServerProtocol

from common.frames import FrameParts

try:
    from websockets.speedups import apply_mask
except ImportError:  # websockets built without its C extension
    from websockets.utils import apply_mask

# Below this a frame's copy costs less than the second write (a system call) it saves.
WRITE_DIRECT_FROM = 1 << 16
# Below this a message's parts cost less joined than written one by one.
JOIN_PARTS_BELOW = 128 << 10


def websocket_header(frame: Frame, length: int, mask: bytes = b"") -> bytes:
    """A frame's header for a payload of ``length`` bytes, masked with ``mask`` when one
    is given (RFC 6455 §5.2)."""
    first = (
        (0x80 if frame.fin else 0)
        | (0x40 if frame.rsv1 else 0)
        | (0x20 if frame.rsv2 else 0)
        | (0x10 if frame.rsv3 else 0)
        | frame.opcode
    )
    masked = 0x80 if mask else 0
    if length < 126:
        return struct.pack("!BB", first, masked | length) + mask
    if length < 1 << 16:
        return struct.pack("!BBH", first, masked | 126, length) + mask
    return struct.pack("!BBQ", first, masked | 127, length) + mask


class _WritesLarge(Protocol):
    """websockets' protocol, writing a large frame as its header and then its payload."""

    def send_frame(self, frame: Frame) -> None:
        data: Any = frame.data
        if isinstance(data, FrameParts) and (self.extensions or len(data) < JOIN_PARTS_BELOW):
            # An extension transforms the payload as a whole.
            data = data.join()
            frame = Frame(frame.opcode, data, frame.fin)
        if isinstance(data, FrameParts):
            parts: tuple[Any, ...] = data.parts
        # Most frames are small (heartbeats, acks, small tasks): len() decides for them
        # without a memoryview made.
        elif (
            self.extensions
            or len(data) < WRITE_DIRECT_FROM
            or not (view := memoryview(data)).c_contiguous
        ):
            super().send_frame(frame)
            return
        else:
            parts = (view,)
        frame.check()  # as serializing it would
        if self.debug:
            self.logger.debug("> %s, %d bytes written as they lie", frame.opcode.name, len(data))
        mask = secrets.token_bytes(4) if self.side is Side.CLIENT else b""
        writes = payload_writes(parts, mask)
        self.writes.append(websocket_header(frame, sum(len(w) for w in writes), mask))
        self.writes.extend(writes)  # type: ignore[arg-type]  # the transport takes any buffer


def payload_writes(parts: Sequence[Any], mask: bytes = b"") -> list[bytes | memoryview]:
    """A payload made of ``parts``, as the buffers to write behind its header: each part
    as it lies, or each masked with ``mask`` (turned to where the part starts in the
    payload) into new bytes."""
    views = [memoryview(part) for part in parts]
    views = [v.cast("B") if v.c_contiguous else memoryview(v.tobytes()) for v in views]
    if not mask:
        return list(views)
    writes: list[bytes | memoryview] = []
    at = 0
    for view in views:
        turn = at % 4
        writes.append(apply_mask(view, mask[turn:] + mask[:turn]))
        at += view.nbytes
    return writes


class _ServerWrites(_WritesLarge, ServerProtocol):
    pass


class _ClientWrites(_WritesLarge, ClientProtocol):
    pass


_WRITES = {ServerProtocol: _ServerWrites, ClientProtocol: _ClientWrites}


class FrameWrites:
    """Mixed into websockets' asyncio ``ServerConnection`` or ``ClientConnection``:
    websockets builds each connection's protocol itself, so the protocol's class is
    swapped here for one that writes large frames as above (it adds no state of its
    own), and ``send`` takes a ``FrameParts`` as one message."""

    protocol: Protocol
    send_in_progress: asyncio.Future[None] | None

    def __init__(self, protocol: Protocol, *args: Any, **kwargs: Any) -> None:
        writes = _WRITES.get(type(protocol))  # type: ignore[call-overload]
        if writes is not None:
            protocol.__class__ = writes
        super().__init__(protocol, *args, **kwargs)  # type: ignore[call-arg]

    async def send(self, message: Any, text: bool | None = None) -> None:
        """websockets' ``send``; a ``FrameParts`` goes out as one binary frame."""
        if not isinstance(message, FrameParts):
            await super().send(message, text=text)  # type: ignore[misc]
            return
        # As websockets' own send: a fragmented message in progress goes out first.
        while self.send_in_progress is not None:
            await asyncio.shield(self.send_in_progress)
        async with self.send_context():  # type: ignore[attr-defined]
            self.protocol.send_binary(message)  # type: ignore[arg-type]
