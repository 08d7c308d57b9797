"""Both ends' WebSocket connections write large frames from the sender's buffers
(common.frame_writes): the coordinator's ``ZeroCopyConnection`` to a stock websockets
client and the worker's ``DirectReadConnection`` to a stock websockets server, on
127.0.0.1, plain and TLS. Every message must arrive byte for byte, at the frame sizes
where the header's length field changes form and around the size where frames start to
go out uncopied, whole and in fragments of every kind of buffer the ends send; a message
held as its parts (``FrameParts``) arrives as one frame, masked when a client sends it."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.certs import tls_contexts
from support.ws_streams import digest, payload
from support.zero_copy_pair import zero_copy_pair
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.connection import Connection
from websockets.asyncio.server import ServerConnection
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.protocol import Side, State
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

from client_app.connection import DirectReadConnection
from common import frame_writes
from common.frame_writes import JOIN_PARTS_BELOW, WRITE_DIRECT_FROM, websocket_header
from common.frames import FrameParts
from coordinator.serve.zero_copy import ZeroCopyConnection

pytestmark = [pytest.mark.loopback, pytest.mark.timeout(60)]

SIZES = (0, 1, 125, 126, 127, 65535, WRITE_DIRECT_FROM - 1, WRITE_DIRECT_FROM)
SIZES += (WRITE_DIRECT_FROM + 1, (1 << 20) + 3, 3 << 20)

Message = bytes | str | list[object] | FrameParts


def _messages() -> list[Message]:
    """Whole messages of each size, a text message, and messages made of the buffers the
    ends hand websockets (bytes, bytearrays, memoryviews of numpy and torch memory, a
    float32 view among them, and slices of those), as fragments and as ``FrameParts``
    of every size around the threshold, parts of every length mod 4 (a client masks
    each part from where it starts)."""
    messages: list[Message] = [payload(n, n) for n in SIZES]
    messages.append("a text frame " * 10_000)
    floats = torch.arange(300_000, dtype=torch.float32)
    block = torch.from_numpy(np.frombuffer(payload(1 << 18, 7), dtype=np.uint8).copy())
    parts = [
        b"head",
        memoryview(floats.numpy()),  # format "f": its length counts floats, not bytes
        bytearray(payload(WRITE_DIRECT_FROM, 3)),
        memoryview(block.numpy())[5 : 5 + WRITE_DIRECT_FROM + 17],
        payload(70_001, 4),
        b"tai",
        payload(WRITE_DIRECT_FROM + 2, 5),
    ]
    messages.append(parts)
    messages.append(FrameParts(parts))
    for n in (1, 125, WRITE_DIRECT_FROM - 5, WRITE_DIRECT_FROM, (1 << 20) + 3):
        messages.append(FrameParts([b"head", b"", payload(n, n + 1)]))
    return messages


# The messages sent as FrameParts, at the end of the list.
AS_PARTS = 6


def _as_bytes(message: Message) -> bytes | str:
    if isinstance(message, list | FrameParts):
        return b"".join(memoryview(part).cast("B").tobytes() for part in message)  # type: ignore[arg-type]
    return message


class _Taken:
    """What the receiving end got: its messages, and each data frame it parsed (opcode,
    fin, masked)."""

    def __init__(self) -> None:
        self.messages: list[bytes | str] = []
        self.frames: list[tuple[Opcode, bool]] = []

    def count_frames(self, ws: Connection) -> None:
        parsed = ws.protocol.recv_frame

        def recv_frame(frame: Frame) -> None:
            if frame.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
                self.frames.append((frame.opcode, frame.fin))
            parsed(frame)

        ws.protocol.recv_frame = recv_frame  # type: ignore[method-assign]

    async def take(self, ws: Connection) -> None:
        async for message in ws:
            self.messages.append(message)


def _pair(
    handler: Any,
    server: type[ServerConnection],
    client: type[ClientConnection],
    tls: tuple[ssl.SSLContext, ssl.SSLContext] | None,
) -> contextlib.AbstractAsyncContextManager[ClientConnection]:
    server_tls, client_tls = tls or (None, None)
    return zero_copy_pair(handler, server_tls, client_tls, server, client)


async def _server_sends(messages: Sequence[Message], tls: Any) -> tuple[_Taken, Any]:
    """ZeroCopyConnection sends to a stock client; the client's close code and reason."""
    taken = _Taken()

    async def handler(ws: ServerConnection) -> None:
        await ws.recv()  # the client counts frames from here
        for message in messages:
            await ws.send(message)  # type: ignore[arg-type]
        await ws.close(1000, "done")

    async with _pair(handler, ZeroCopyConnection, ClientConnection, tls) as ws:
        taken.count_frames(ws)
        await ws.send("go")
        await taken.take(ws)
    return taken, (ws.close_code, ws.close_reason)


async def _client_sends(messages: Sequence[Message], tls: Any) -> tuple[_Taken, Any]:
    """DirectReadConnection sends to a stock server; the server's close code and reason."""
    taken, closed = _Taken(), asyncio.get_running_loop().create_future()

    async def handler(ws: ServerConnection) -> None:
        taken.count_frames(ws)
        await ws.send("go")
        await taken.take(ws)
        closed.set_result((ws.close_code, ws.close_reason))

    async with _pair(handler, ServerConnection, DirectReadConnection, tls) as ws:
        await ws.recv()
        for message in messages:
            await ws.send(message)  # type: ignore[arg-type]
        await ws.close(1000, "done")
        return taken, await closed


@pytest.mark.parametrize("tls", [False, True])
@pytest.mark.parametrize("sender", ["server", "client"])
async def test_every_message_arrives_byte_for_byte(sender: str, tls: bool, tmp_path: Path) -> None:
    contexts = tls_contexts(tmp_path) if tls else None
    messages = _messages()
    exchange = _server_sends if sender == "server" else _client_sends
    taken, closed = await asyncio.wait_for(exchange(messages, contexts), 30)
    expected = [_as_bytes(m) for m in messages]
    assert [len(m) for m in taken.messages] == [len(m) for m in expected]
    assert [digest(m) for m in taken.messages] == [digest(m) for m in expected]
    assert closed == (1000, "done")
    # Whole messages and FrameParts are a frame each; fragments a frame per part and a
    # closing empty one.
    fragments = sum(len(m) + 1 for m in messages if isinstance(m, list))
    whole = len(messages) - sum(isinstance(m, list) for m in messages)
    assert len(taken.frames) == whole + fragments
    assert all(isinstance(m, FrameParts) for m in messages[-AS_PARTS:])
    assert taken.frames[-AS_PARTS:] == [(Opcode.BINARY, True)] * AS_PARTS


def test_both_ends_connections_write_through_frame_writes() -> None:
    async def protocols() -> list[str]:
        names: list[str] = []

        async def handler(ws: ServerConnection) -> None:
            names.append(type(ws.protocol).__name__)
            await ws.close()

        async with _pair(handler, ZeroCopyConnection, DirectReadConnection, None) as ws:
            names.append(type(ws.protocol).__name__)
            await ws.wait_closed()
        return names

    assert sorted(asyncio.run(protocols())) == ["_ClientWrites", "_ServerWrites"]


@pytest.mark.parametrize("side", [Side.SERVER, Side.CLIENT])
def test_small_parts_go_out_joined_and_large_ones_as_they_lie(side: Side) -> None:
    # A part costs a write of its own: a small message is cheaper copied into one
    # buffer; a large one keeps its shared blocks uncopied (a server's) or masked
    # straight from them (a client's).
    head, block = b"head", payload(64 << 10, 1)
    small = FrameParts([head, block[: JOIN_PARTS_BELOW // 2 - 10], head])
    large = FrameParts([head, block, memoryview(block)[:-3]] * (JOIN_PARTS_BELOW // len(block)))
    protocol = ServerProtocol() if side is Side.SERVER else ClientProtocol(parse_uri("ws://h/"))
    protocol.__class__ = frame_writes._WRITES[type(protocol)]
    protocol.state = State.OPEN
    protocol.send_binary(small)  # type: ignore[arg-type]
    writes = protocol.data_to_send()
    assert len(writes) == 1 and len(writes[0]) > len(small)
    protocol.send_binary(large)  # type: ignore[arg-type]
    writes = protocol.data_to_send()
    assert len(writes) == 1 + len(large.parts)
    for write, part in zip(writes[1:], large.parts, strict=True):
        if side is Side.SERVER:
            assert memoryview(write).obj is memoryview(part).obj  # not copied
        else:
            assert isinstance(write, bytes) and len(write) == len(memoryview(part))


@pytest.mark.parametrize("length", [0, 125, 126, 65535, 65536, 1 << 32])
def test_frame_head_is_rfc_6455(length: int) -> None:
    """Against websockets' own serializer: the same header for the same frame, masked or
    not."""
    for opcode, fin in ((Opcode.BINARY, True), (Opcode.BINARY, False), (Opcode.CONT, True)):
        small = min(length, 1 << 17)  # websockets needs the payload itself
        frame = Frame(opcode, b"\0" * small, fin)
        theirs = frame.serialize(mask=False, extensions=[])
        ours = websocket_header(frame, small)
        assert theirs[: len(ours)] == ours and len(theirs) == len(ours) + small
        masked = frame.serialize(mask=True, extensions=[])
        mask = masked[len(ours) : len(ours) + 4]
        assert masked[: len(ours) + 4] == websocket_header(frame, small, mask)
    if length > 1 << 17:
        head = websocket_header(Frame(Opcode.BINARY, b""), length)
        assert head[1] == 127 and int.from_bytes(head[2:], "big") == length
