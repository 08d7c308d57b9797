"""The worker's WebSocket connection to its coordinator reads a large frame's payload
straight into a buffer of its size (``client_app.connection.DirectReadConnection``, made
of common.frame_reads), and hands every other frame to websockets. On 127.0.0.1: a raw
server's byte streams of server frames, cut at every kind of place (inside a header, a
payload, at frame boundaries), good and bad, end exactly as they do on websockets' own
``ClientConnection``: the same messages, the same close codes and reasons, the same
parser error; frames that arrive in the same read as the handshake's 101 response
arrive whole, and the reader takes over after them; and a stock websockets server's
messages, plain and TLS, arrive byte for byte through ``open_connection``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import ssl
import struct
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support import ws_streams
from support.certs import tls_contexts
from support.ws_streams import digest, joined_digest, sized_messages
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import Opcode

from client_app.connection import DirectReadConnection, close_quietly, open_connection
from common.frame_reads import READ_DIRECT_FROM

pytestmark = [pytest.mark.loopback, pytest.mark.timeout(120)]

BIG = READ_DIRECT_FROM
MAX_SIZE = 1 << 21  # the clients' max_size in the raw-stream cases
WAIT_S = 20.0
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 §1.3


# ---- a raw server: byte streams cut where the test says ----------------------------------


def _frame(
    opcode: Opcode, data: bytes, fin: bool = True, *, masked: bool = False, rsv1: bool = False
) -> bytes:
    """A server's frame (unmasked unless told)."""
    return ws_streams.frame(opcode, data, fin, masked=masked, rsv1=rsv1)


_SIDE = ws_streams.streams(masked=False, big=BIG, max_size=MAX_SIZE)
STREAMS, GOOD_MESSAGES, _P, CLOSE = _SIDE.streams, _SIDE.good_messages, _SIDE.payloads, _SIDE.close


def _switching_protocols(request: bytes) -> bytes:
    """The server's answer to the client's upgrade request (RFC 6455 §4.2.2)."""
    key = next(
        line.split(b":", 1)[1].strip()
        for line in request.split(b"\r\n")
        if line.lower().startswith(b"sec-websocket-key:")
    )
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    return (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
    )


@dataclass
class _Outcome:
    digests: list[str] = field(default_factory=list)
    closed: str = ""  # how the client's iteration ended
    close_sent: tuple[int, str] | None = None
    close_rcvd: tuple[int, str] | None = None
    parser_error: str = ""  # what websockets' parser stopped on, if anything


class _Session:
    """One client connected through ``connection`` to the raw server: the server's end
    of it, and what the client read and made of it."""

    def __init__(self, connection: type[ClientConnection]) -> None:
        self.outcome = _Outcome()
        self.done = asyncio.Event()  # the client's iteration ended
        self.progress = asyncio.Event()  # set by every read, and when the client ends
        self.read = 0  # bytes the client read, the 101 response's included
        self.sent = 0
        self.taken = 0  # frames the reader read itself
        self.conns: list[ClientConnection] = []
        self.response = b""
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter
        session = self

        class Counted(connection):  # type: ignore[valid-type,misc]
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, **kwargs)
                session.conns.append(self)

            def data_received(self, data: bytes) -> None:
                if connection is ClientConnection:
                    session.read += len(data)
                    session.progress.set()
                super().data_received(data)

            def buffer_updated(self, nbytes: int) -> None:
                session.read += nbytes
                session.progress.set()
                super().buffer_updated(nbytes)

            def _deliver(self, payload: object) -> None:
                session.taken += 1
                super()._deliver(payload)

        self.connection = Counted

    @property
    def conn(self) -> ClientConnection:
        return self.conns[0]

    async def client(self, port: int) -> None:
        ws = await connect(
            f"ws://127.0.0.1:{port}",
            compression=None,
            max_size=MAX_SIZE,
            ping_interval=None,  # no pings of its own in the streams it writes
            create_connection=self.connection,
        )
        outcome = self.outcome
        try:
            async for message in ws:
                outcome.digests.append(digest(message))
        except ConnectionClosed as exc:
            outcome.closed = type(exc).__name__
        else:
            outcome.closed = "clean"
        sent, rcvd = ws.protocol.close_sent, ws.protocol.close_rcvd
        outcome.close_sent = None if sent is None else (sent.code, sent.reason)
        outcome.close_rcvd = None if rcvd is None else (rcvd.code, rcvd.reason)
        outcome.parser_error = repr(ws.protocol.parser_exc)
        self.done.set()
        self.progress.set()

    async def send(self, data: bytes) -> None:
        """Write ``data`` and wait until the client has read it and all before it."""
        self.writer.write(data)
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()
        self.sent += len(data)
        while self.read < self.sent and not self.done.is_set():
            self.progress.clear()  # no read can land between the check and here: one thread
            await asyncio.wait_for(self.progress.wait(), WAIT_S)

    async def hang_up(self, *, at_once: bool = False) -> None:
        """Close the TCP connection: once the client's close frame came, where it sent
        one (as a server does), or ``at_once``; then wait for the client to end."""
        if not at_once and self.conn.protocol.close_sent is not None:
            await asyncio.wait_for(self._close_frame(), WAIT_S)
        self.writer.close()
        await asyncio.wait_for(self.done.wait(), WAIT_S)

    async def _close_frame(self) -> None:
        """Read the client's frames (masked) up to its close frame."""
        while True:
            first, second = await self.reader.readexactly(2)
            length = second & 0x7F
            if length == 126:
                (length,) = struct.unpack("!H", await self.reader.readexactly(2))
            elif length == 127:
                (length,) = struct.unpack("!Q", await self.reader.readexactly(8))
            await self.reader.readexactly(length + (4 if second & 0x80 else 0))
            if first & 0x0F == Opcode.CLOSE:
                return


@contextlib.asynccontextmanager
async def _raw_server(connection: type[ClientConnection]) -> AsyncIterator[_Session]:
    """A session whose client sent its upgrade request; the test answers it (with
    ``session.response``), sends the stream and hangs up."""
    served: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
    served = asyncio.get_running_loop().create_future()
    server = await asyncio.start_server(
        lambda reader, writer: served.set_result((reader, writer)), "127.0.0.1", 0
    )
    session = _Session(connection)
    async with server:
        port = server.sockets[0].getsockname()[1]
        client = asyncio.create_task(session.client(port))
        try:
            session.reader, session.writer = await asyncio.wait_for(served, WAIT_S)
            request = await asyncio.wait_for(session.reader.readuntil(b"\r\n\r\n"), WAIT_S)
            session.response = _switching_protocols(request)
            yield session
            await asyncio.wait_for(client, WAIT_S)  # its errors, if any
        finally:
            client.cancel()
            if served.done():
                served.result()[1].close()


async def _play(
    connection: type[ClientConnection], frames: list[bytes], cuts: list[int], end_at: int | None
) -> tuple[_Outcome, int]:
    """Send the stream in pieces, each after the client read all before it; what the
    client made of it, and how many frames DirectReadConnection read itself."""
    stream = b"".join(frames)
    if end_at is not None:
        stream = stream[:end_at]
    async with _raw_server(connection) as session:
        # The 101 alone first: the reader then reads from the stream's first byte on.
        await session.send(session.response)
        at = 0
        for cut in [*(c for c in cuts if c < len(stream)), len(stream)]:
            await session.send(stream[at:cut])
            at = cut
        await session.hang_up(at_once=end_at is not None)
    return session.outcome, session.taken


@pytest.mark.parametrize("how", ["whole", "frames", "headers", "inside"])
@pytest.mark.parametrize("name", list(STREAMS))
async def test_a_stream_ends_as_it_does_on_websockets_own_connection(name: str, how: str) -> None:
    frames, end_at = STREAMS[name]
    cuts = ws_streams.cuts(frames, how)
    theirs, _ = await _play(ClientConnection, frames, cuts, end_at)
    ours, taken = await _play(DirectReadConnection, frames, cuts, end_at)
    ws_streams.assert_ends_alike(name, ours, theirs, taken, GOOD_MESSAGES)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("connection", [ClientConnection, DirectReadConnection])
async def test_frames_in_the_read_of_the_101_arrive_and_the_reader_takes_over_after(
    connection: type[ClientConnection], split: bool
) -> None:
    """Frames that come in the same read as the handshake's response are websockets' to
    read, and so is the rest of a frame begun there (``split``); the reader engages at
    the first read that starts at a frame's start."""
    large = _frame(Opcode.BINARY, _P[14])
    first = _frame(Opcode.BINARY, _P[18]) + (large[:5000] if split else large)
    rest = large[5000:] if split else b""
    then = [_frame(Opcode.BINARY, _P[11]), _frame(Opcode.BINARY, _P[17])]
    async with _raw_server(connection) as session:
        await session.send(session.response + first)
        framings = [getattr(session.conn, "_framing", None)]
        if rest:
            await session.send(rest)  # a read while websockets holds part of a frame
            framings.append(getattr(session.conn, "_framing", None))
        await session.send(b"".join(then))
        framings.append(getattr(session.conn, "_framing", None))
        await session.send(CLOSE)
        await session.hang_up()
    assert session.outcome.digests == [digest(m) for m in (_P[18], _P[14], _P[11], _P[17])]
    assert session.outcome.closed == "clean" and session.outcome.close_sent == (1000, "bye")
    if connection is DirectReadConnection:
        # Not while websockets held the first frames, then from the next frame's start.
        assert framings == [None] * (len(framings) - 1) + [True]
        assert session.taken == len(then)


# ---- a stock server, through the worker's open_connection --------------------------------


async def _receive_all(
    messages: Sequence[bytes | list[bytes]],
    server_tls: ssl.SSLContext | None,
    client_tls: ssl.SSLContext | None,
) -> tuple[list[str], bool | None]:
    """What the worker's connection received (digests), and whether it read the frames
    itself. The server speaks first and waits for an answer, as the coordinator does
    (its challenge): the reader engages only at a read that starts at a frame's start,
    and a server that streams from its 101 on may never leave the client such a read
    (each read ends inside a frame)."""

    async def handler(ws: ServerConnection) -> None:
        await ws.send(b"challenge")
        assert await ws.recv() == b"answer"
        for message in messages:
            await ws.send(message)
        await ws.wait_closed()

    async with serve(
        handler, "127.0.0.1", 0, ssl=server_tls, compression=None, max_size=None
    ) as server:
        port = server.sockets[0].getsockname()[1]
        scheme = "wss" if client_tls else "ws"
        ws = await open_connection(
            f"{scheme}://127.0.0.1:{port}", tls=client_tls, max_size=8 << 20, stop=asyncio.Event()
        )
        assert isinstance(ws, DirectReadConnection)
        try:
            assert await ws.recv() == b"challenge"
            await ws.send(b"answer")
            got = [digest(await ws.recv()) for _ in messages]
            framing = ws._framing  # before the close, which ends the reader's part
        finally:
            await close_quietly(ws)
    return got, framing


@pytest.mark.parametrize("tls", [False, True])
async def test_every_message_a_server_sends_arrives_byte_for_byte(
    tls: bool, tmp_path: Path
) -> None:
    server_tls, client_tls = tls_contexts(tmp_path) if tls else (None, None)
    messages = sized_messages(BIG)
    got, framing = await asyncio.wait_for(_receive_all(messages, server_tls, client_tls), 60)
    assert got == [joined_digest(m) for m in messages]
    assert framing is True  # the frames were read by DirectReadConnection, not websockets
