"""The coordinator's WebSocket connections read a large frame's payload straight into a
buffer of its size (common.frame_reads), and hand every other frame to
websockets. On 127.0.0.1, plain and TLS: a stock websockets client's messages arrive
byte for byte; and a raw client's byte streams, cut at every kind of place (inside a
header, a mask, a payload, at frame boundaries), good and bad, end exactly as they do on
websockets' own connection: the same messages, the same close code and reason."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import pytest
from support import ws_streams
from support.certs import tls_contexts
from support.ws_streams import digest, joined_digest, sized_messages
from support.zero_copy_pair import zero_copy_pair
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.server import ServerProtocol

from common import frame_reads
from coordinator.serve.zero_copy import ZeroCopyConnection

pytestmark = [pytest.mark.loopback, pytest.mark.timeout(120)]

BIG = frame_reads.READ_DIRECT_FROM
MAX_SIZE = 1 << 21  # the servers' max_size in the raw-stream cases
WAIT_S = 20.0


# ---- a stock client ----------------------------------------------------------------------


async def _send_all(
    messages: Sequence[bytes | list[bytes]],
    server_tls: ssl.SSLContext | None,
    client_tls: ssl.SSLContext | None,
) -> tuple[list[str], bool | None]:
    """What the server received (digests), and whether it read the frames itself."""
    got: list[str] = []
    framing: list[bool | None] = []

    async def handler(ws: ServerConnection) -> None:
        for _ in messages:
            got.append(digest(await ws.recv()))
        framing.append(getattr(ws, "_framing", None))
        await ws.send("done")

    async with zero_copy_pair(handler, server_tls, client_tls) as ws:
        for message in messages:
            await ws.send(message)
        assert await ws.recv() == "done"
    return got, framing[0]


@pytest.mark.parametrize("tls", [False, True])
async def test_every_message_a_client_sends_arrives_byte_for_byte(
    tls: bool, tmp_path: Path
) -> None:
    server_tls, client_tls = tls_contexts(tmp_path) if tls else (None, None)
    messages = sized_messages(BIG)
    got, framing = await asyncio.wait_for(_send_all(messages, server_tls, client_tls), 60)
    assert got == [joined_digest(m) for m in messages]
    assert framing is True  # the frames were read by ZeroCopyConnection, not websockets


async def test_websockets_reads_every_frame_where_its_protocol_is_laid_out_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An older websockets, without the limits the connection reads: it leaves the
    frames to websockets, and every message still arrives."""
    monkeypatch.setattr(frame_reads, "_PROTOCOL_STATE", ("max_size_of_another_version",))
    messages = sized_messages(BIG)
    got, framing = await asyncio.wait_for(_send_all(messages, None, None), 60)
    assert got == [joined_digest(m) for m in messages]
    assert framing is False


# ---- a raw client: byte streams cut where the test says ----------------------------------

HANDSHAKE = (
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


_SIDE = ws_streams.streams(masked=True, big=BIG, max_size=MAX_SIZE)
STREAMS, GOOD_MESSAGES, _P, CLOSE = _SIDE.streams, _SIDE.good_messages, _SIDE.payloads, _SIDE.close


@dataclass
class _Outcome:
    digests: list[str] = field(default_factory=list)
    closed: str = ""  # how the server's recv ended
    close_sent: tuple[int, str] | None = None
    parser_error: str = ""  # what websockets' parser stopped on, if anything


async def _play(
    connection: type[ServerConnection], frames: list[bytes], cuts: list[int], end_at: int | None
) -> tuple[_Outcome, int]:
    """Send the stream in pieces, each after the server read all before it; what the
    server made of it, and how many frames ZeroCopyConnection read itself."""
    outcome = _Outcome()
    done = asyncio.Event()
    read = [0]
    taken = [0]
    progress = asyncio.Event()  # set by every read, and when the handler ends

    class Counted(connection):  # type: ignore[valid-type,misc]
        def data_received(self, data: bytes) -> None:
            if connection is ServerConnection:
                read[0] += len(data)
                progress.set()
            super().data_received(data)

        def buffer_updated(self, nbytes: int) -> None:
            read[0] += nbytes
            progress.set()
            super().buffer_updated(nbytes)

        def _deliver(self, payload: object) -> None:
            taken[0] += 1
            super()._deliver(payload)

    async def handler(ws: ServerConnection) -> None:
        try:
            async for message in ws:
                outcome.digests.append(digest(message))
        except ConnectionClosed as exc:
            outcome.closed = type(exc).__name__
        else:
            outcome.closed = "clean"
        sent = ws.protocol.close_sent
        outcome.close_sent = None if sent is None else (sent.code, sent.reason)
        outcome.parser_error = repr(ws.protocol.parser_exc)
        done.set()
        progress.set()

    async def read_up_to(total: int) -> None:
        while read[0] < total and not done.is_set():
            progress.clear()  # no read can land between the check and here: one thread
            await asyncio.wait_for(progress.wait(), WAIT_S)

    stream = b"".join(frames)
    if end_at is not None:
        stream = stream[:end_at]
    async with serve(
        handler, "127.0.0.1", 0, compression=None, max_size=MAX_SIZE, create_connection=Counted
    ) as server:
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HANDSHAKE)
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        assert answer.startswith(b"HTTP/1.1 101")
        at = 0
        for cut in [*(c for c in cuts if c < len(stream)), len(stream)]:
            if done.is_set():
                break
            try:
                writer.write(stream[at:cut])
                await writer.drain()
            except ConnectionError:
                break
            at = cut
            await read_up_to(len(HANDSHAKE) + at)
        if end_at is not None or not done.is_set():
            writer.close()
        await asyncio.wait_for(done.wait(), WAIT_S)
        writer.close()
    return outcome, taken[0]


@pytest.mark.parametrize("how", ["whole", "frames", "headers", "inside"])
@pytest.mark.parametrize("name", list(STREAMS))
async def test_a_stream_ends_as_it_does_on_websockets_own_connection(name: str, how: str) -> None:
    frames, end_at = STREAMS[name]
    cuts = ws_streams.cuts(frames, how)
    theirs, _ = await _play(ServerConnection, frames, cuts, end_at)
    ours, taken = await _play(ZeroCopyConnection, frames, cuts, end_at)
    ws_streams.assert_ends_alike(name, ours, theirs, taken, GOOD_MESSAGES)


async def test_a_read_nested_in_handling_a_read_gets_its_own_buffer() -> None:
    """TLS reads what is left when websockets closes the transport, from inside the
    handling of a read: that read must not land in the buffer being handled."""
    first, second = (ZeroCopyConnection(ServerProtocol(), None) for _ in range(2))  # type: ignore[arg-type]
    shared = first.get_buffer(-1)
    nested: list[memoryview] = []
    first.data_received = lambda data: nested.append(second.get_buffer(-1))  # type: ignore[method-assign]
    shared[:4] = b"GET "
    first.buffer_updated(4)
    assert len(nested) == 1 and nested[0] is not shared and len(nested[0]) == len(shared)
    assert second.get_buffer(-1) is shared  # lent no more


def test_payload_buffers_are_reused_within_bounds() -> None:
    buffers = frame_reads._Buffers()
    kept = buffers.take(100_000)
    buffers.give(kept)
    assert buffers.take(90_000) is kept  # the smallest one that fits
    buffers.give(kept)
    assert len(buffers.take(200_000)) == 200_000  # none fits: a new one
    assert len(buffers.kept) == 1 and buffers.kept[0] is kept
    huge = buffers.take(frame_reads.KEPT_UP_TO + 1)
    buffers.give(huge)
    assert all(b is not huge for b in buffers.kept)  # its memory goes back
    for n in range(frame_reads.KEPT_BUFFERS + 2):
        buffers.give(np.empty(1000 + n, dtype=np.uint8))
    assert len(buffers.kept) == frame_reads.KEPT_BUFFERS
    assert any(b is kept for b in buffers.kept)  # the smallest were let go


def test_a_frame_announced_is_not_held_in_memory_before_it_arrives() -> None:
    """A header says how large its payload will be; the buffer for it takes memory only
    as the payload arrives, so headers alone cannot make the coordinator hold memory."""
    process = psutil.Process()
    before = process.memory_info().rss
    buffer = frame_reads._Buffers().take(256 << 20)
    grew = process.memory_info().rss - before
    assert len(buffer) == 256 << 20
    assert grew < 64 << 20, f"{grew >> 20} MiB held for a payload not yet sent"
