"""The coordinator's WebSocket connections write large frames from the sender's buffer
(coordinator.serve.zero_copy): a stock websockets client on 127.0.0.1, plain and TLS,
must receive every message byte for byte, at the frame sizes where the header's length
field changes form and around the size where frames start to go out uncopied, in whole
messages and in fragments of every kind of buffer the coordinator sends; a task held as
its parts (``FrameParts``) arrives as one frame."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from support.certs import tls_contexts
from support.zero_copy_pair import zero_copy_pair
from websockets.asyncio.server import ServerConnection
from websockets.frames import Frame, Opcode

from common.frames import FrameParts
from coordinator.serve import zero_copy
from coordinator.serve.zero_copy import ZERO_COPY_FROM

pytestmark = [pytest.mark.loopback, pytest.mark.timeout(60)]

SIZES = (0, 1, 125, 126, 127, 65535, ZERO_COPY_FROM - 1, ZERO_COPY_FROM, ZERO_COPY_FROM + 1)
SIZES += ((1 << 20) + 3, 3 << 20)


def _payload(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


Message = bytes | str | list[object] | FrameParts


def _messages() -> list[Message]:
    """Whole messages of each size, a text message, and messages made of the buffers the
    coordinator hands websockets (bytes, bytearrays, memoryviews of numpy and torch
    memory, a float32 view among them, and slices of those), as fragments and as
    ``FrameParts`` of every size around the threshold."""
    messages: list[Message] = [_payload(n, n) for n in SIZES]
    messages.append("a text frame " * 10_000)
    floats = torch.arange(300_000, dtype=torch.float32)
    block = torch.from_numpy(np.frombuffer(_payload(1 << 18, 7), dtype=np.uint8).copy())
    parts = [
        b"head",
        memoryview(floats.numpy()),  # format "f": its length counts floats, not bytes
        bytearray(_payload(ZERO_COPY_FROM, 3)),
        memoryview(block.numpy())[5 : 5 + ZERO_COPY_FROM + 17],
        _payload(70_000, 4),
    ]
    messages.append(parts)
    messages.append(FrameParts(parts))
    for n in (1, 125, ZERO_COPY_FROM - 5, ZERO_COPY_FROM, (1 << 20) + 3):
        messages.append(FrameParts([b"head", b"", _payload(n, n + 1)]))
    return messages


def _as_bytes(message: Message) -> bytes | str:
    if isinstance(message, list | FrameParts):
        return b"".join(memoryview(part).cast("B").tobytes() for part in message)  # type: ignore[arg-type]
    return message


def _digest(message: bytes | str) -> str:
    return hashlib.sha256(message if isinstance(message, bytes) else message.encode()).hexdigest()


async def _exchange(
    messages: Sequence[Message],
    server_tls: ssl.SSLContext | None,
    client_tls: ssl.SSLContext | None,
) -> tuple[list[bytes | str], int | None, str, type, list[tuple[Opcode, bool]]]:
    protocols: list[type] = []

    async def handler(ws: ServerConnection) -> None:
        protocols.append(type(ws.protocol))
        await ws.recv()  # the client counts frames from here
        for message in messages:
            await ws.send(message)  # type: ignore[arg-type]
        await ws.close(1000, "done")

    received: list[bytes | str] = []
    frames: list[tuple[Opcode, bool]] = []  # each data frame the client parsed: opcode, fin
    async with zero_copy_pair(handler, server_tls, client_tls) as ws:
        parsed = ws.protocol.recv_frame

        def recv_frame(frame: Frame) -> None:
            if frame.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
                frames.append((frame.opcode, frame.fin))
            parsed(frame)

        ws.protocol.recv_frame = recv_frame  # type: ignore[method-assign]
        await ws.send("go")
        async for message in ws:
            received.append(message)
    assert ws.close_code is not None
    return received, ws.close_code, ws.close_reason or "", protocols[0], frames


@pytest.mark.parametrize("tls", [False, True])
async def test_every_message_arrives_byte_for_byte(tls: bool, tmp_path: Path) -> None:
    server_tls = client_tls = None
    if tls:
        server_tls, client_tls = tls_contexts(tmp_path)
    messages = _messages()
    received, code, reason, protocol, frames = await asyncio.wait_for(
        _exchange(messages, server_tls, client_tls), 30
    )
    assert protocol.__name__ == "_ZeroCopyProtocol"
    expected = [_as_bytes(m) for m in messages]
    assert [len(m) for m in received] == [len(m) for m in expected]
    assert [_digest(m) for m in received] == [_digest(m) for m in expected]
    assert (code, reason) == (1000, "done")
    # Whole messages and FrameParts are a frame each; fragments a frame per part and a
    # closing empty one.
    fragments = sum(len(m) + 1 for m in messages if isinstance(m, list))
    assert len(frames) == len(messages) - sum(isinstance(m, list) for m in messages) + fragments
    assert frames[-6:] == [(Opcode.BINARY, True)] * 6


@pytest.mark.parametrize("length", [0, 125, 126, 65535, 65536, 1 << 32])
def test_frame_head_is_rfc_6455(length: int) -> None:
    """Against websockets' own serializer: the same header for the same frame."""
    for opcode, fin in ((Opcode.BINARY, True), (Opcode.BINARY, False), (Opcode.CONT, True)):
        small = min(length, 1 << 17)  # websockets needs the payload itself
        frame = Frame(opcode, b"\0" * small, fin)
        theirs = frame.serialize(mask=False, extensions=[])
        ours = zero_copy.frame_head(frame, small)
        assert theirs[: len(ours)] == ours and len(theirs) == len(ours) + small
    if length > 1 << 17:
        head = zero_copy.frame_head(Frame(Opcode.BINARY, b""), length)
        assert head[1] == 127 and int.from_bytes(head[2:], "big") == length
