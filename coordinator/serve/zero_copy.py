"""A WebSocket server connection that sends a large frame's payload from the buffer it
was given, not from a copy, and receives a large frame's payload straight into a buffer
of its size.

websockets serializes every frame into a new bytes object, its payload copied in behind
its header; for the operand blocks that tasks carry, that is a copy on the event loop of
every byte the coordinator sends. ``ZeroCopyConnection`` writes a frame of
``ZERO_COPY_FROM`` bytes or more to the transport as its header and then its payload as
it lies (the transport copies only what the socket does not take at once). Smaller
frames, and frames an extension would transform, take websockets' own path. A server's
frames are never masked (RFC 6455 §5.1), so the payload goes out as it is.

A task held as its parts (``common.frames.FrameParts``: its head and the operand blocks
it shares with other tasks) goes out as one frame whose header is followed by each part
as it lies. As fragments of one message, each part would be a frame of its own, and the
receiver would join them into one more copy.

The transport may hold on to a payload (TLS encrypts it later), so what the coordinator
sends must not change once handed over: operand blocks are never written after they are
cut, and headers and batches are new bytes.

On the way in, a large frame's payload is read straight into a buffer of its size
(``common.frame_reads``), as on the worker's end.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.frames import Frame
from websockets.server import ServerProtocol

from common.frame_reads import FrameReads
from common.frames import FrameParts

# Below this a frame's copy costs less than the second write (a system call) it saves.
ZERO_COPY_FROM = 1 << 16


def frame_head(frame: Frame, length: int) -> bytes:
    """An unmasked frame's header for a payload of ``length`` bytes (RFC 6455 §5.2)."""
    first = (
        (0x80 if frame.fin else 0)
        | (0x40 if frame.rsv1 else 0)
        | (0x20 if frame.rsv2 else 0)
        | (0x10 if frame.rsv3 else 0)
        | frame.opcode
    )
    if length < 126:
        return struct.pack("!BB", first, length)
    if length < 1 << 16:
        return struct.pack("!BBH", first, 126, length)
    return struct.pack("!BBQ", first, 127, length)


class _ZeroCopyProtocol(ServerProtocol):
    """websockets' server protocol, writing a large frame as header and payload."""

    def send_frame(self, frame: Frame) -> None:
        if isinstance(frame.data, FrameParts):
            self._send_parts(frame, frame.data)
            return
        # Most frames are small (heartbeats, acks, small tasks): len() decides for them
        # without a memoryview made.
        if (
            self.extensions
            or len(frame.data) < ZERO_COPY_FROM
            or not (payload := memoryview(frame.data)).c_contiguous
        ):
            super().send_frame(frame)
            return
        frame.check()  # as serializing it would
        if self.debug:
            self.logger.debug("> %s", frame)
        payload = payload.cast("B")
        self.writes.append(frame_head(frame, payload.nbytes))
        self.writes.append(payload)  # type: ignore[arg-type]  # the transport takes any buffer

    def _send_parts(self, frame: Frame, parts: FrameParts) -> None:
        frame.check()
        if self.debug:
            self.logger.debug(
                "> %s [%d bytes in %d parts]", frame.opcode.name, len(parts), len(parts.parts)
            )
        self.writes.append(frame_head(frame, len(parts)))
        for part in parts:
            view = memoryview(part)
            self.writes.append(view.cast("B") if view.c_contiguous else view.tobytes())  # type: ignore[arg-type]


class ZeroCopyConnection(FrameReads, ServerConnection):
    """``serve(create_connection=ZeroCopyConnection)``. websockets builds each
    connection's protocol itself, so the protocol's class is swapped here for one that
    writes large frames without copying them (it adds no state of its own); the reads
    are ``FrameReads``'."""

    def __init__(self, protocol: ServerProtocol, *args: Any, **kwargs: Any) -> None:
        protocol.__class__ = _ZeroCopyProtocol
        super().__init__(protocol, *args, **kwargs)

    async def send(self, message: Any, text: bool | None = None) -> None:
        """websockets' ``send``; a ``FrameParts`` goes out as one binary frame."""
        if not isinstance(message, FrameParts):
            await super().send(message, text=text)
        elif self.protocol.extensions:  # an extension transforms the payload as a whole
            await super().send(message.join())
        else:
            # As websockets' own send: a fragmented message in progress goes out first.
            while self.send_in_progress is not None:
                await asyncio.shield(self.send_in_progress)
            async with self.send_context():
                self.protocol.send_binary(message)  # type: ignore[arg-type]
