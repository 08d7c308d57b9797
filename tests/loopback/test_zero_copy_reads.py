"""The coordinator's WebSocket connections read a large frame's payload straight into a
buffer of its size (common.frame_reads), and hand every other frame to
websockets. On 127.0.0.1, plain and TLS: a stock websockets client's messages arrive
byte for byte; and a raw client's byte streams, cut at every kind of place (inside a
header, a mask, a payload, at frame boundaries), good and bad, end exactly as they do on
websockets' own connection: the same messages, the same close code and reason."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import pytest
from support.certs import tls_contexts
from support.zero_copy_pair import zero_copy_pair
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close, Opcode
from websockets.server import ServerProtocol

from common import frame_reads
from coordinator.serve.zero_copy import ZERO_COPY_FROM, ZeroCopyConnection

pytestmark = [pytest.mark.loopback, pytest.mark.timeout(120)]

BIG = ZERO_COPY_FROM
MAX_SIZE = 1 << 21  # the servers' max_size in the raw-stream cases
WAIT_S = 20.0


def _payload(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _digest(message: bytes | str) -> str:
    return hashlib.sha256(message if isinstance(message, bytes) else message.encode()).hexdigest()


# ---- a stock client ----------------------------------------------------------------------


def _client_messages() -> list[bytes | list[bytes]]:
    """Whole messages on both sides of the sizes where the length field changes form and
    where payloads start to be read directly, and fragmented messages whose fragments
    are large, small and mixed."""
    sizes = (0, 1, 125, 126, 65535, BIG - 1, BIG, BIG + 1, (1 << 20) + 3, 3 << 20)
    messages: list[bytes | list[bytes]] = [_payload(n, n) for n in sizes]
    messages.append([_payload(BIG + 5, 1), _payload(7, 2), _payload(3 * BIG, 3)])
    messages.append([_payload(10, 4), _payload(BIG, 5)])
    messages.append([_payload(2 * BIG, 6), _payload(BIG, 7)])
    return messages


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
            got.append(_digest(await ws.recv()))
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
    server_tls = client_tls = None
    if tls:
        server_tls, client_tls = tls_contexts(tmp_path)
    messages = _client_messages()
    got, framing = await asyncio.wait_for(_send_all(messages, server_tls, client_tls), 60)
    expected = [_digest(m if isinstance(m, bytes) else b"".join(m)) for m in messages]
    assert got == expected
    assert framing is True  # the frames were read by ZeroCopyConnection, not websockets


async def test_websockets_reads_every_frame_where_its_protocol_is_laid_out_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An older websockets, without the limits the connection reads: it leaves the
    frames to websockets, and every message still arrives."""
    monkeypatch.setattr(frame_reads, "_PROTOCOL_STATE", ("max_size_of_another_version",))
    messages = _client_messages()
    got, framing = await asyncio.wait_for(_send_all(messages, None, None), 60)
    assert got == [_digest(m if isinstance(m, bytes) else b"".join(m)) for m in messages]
    assert framing is False


# ---- a raw client: byte streams cut where the test says ----------------------------------

HANDSHAKE = (
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def _frame(
    opcode: Opcode, data: bytes, fin: bool = True, *, masked: bool = True, rsv1: bool = False
) -> bytes:
    """A client's frame as RFC 6455 §5.2 lays it out, also one websockets would refuse to
    build (its serializer checks frames first)."""
    first = (0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode
    bit = 0x80 if masked else 0
    n = len(data)
    if n < 126:
        head = struct.pack("!BB", first, bit | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", first, bit | 126, n)
    else:
        head = struct.pack("!BBQ", first, bit | 127, n)
    if not masked:
        return head + data
    mask = bytes([0x3C, 0xA5, 0x0F, 0x96])
    flat = np.frombuffer(data, dtype=np.uint8)
    keys = np.resize(np.frombuffer(mask, dtype=np.uint8), n)
    return head + mask + (flat ^ keys).tobytes()


CLOSE = _frame(Opcode.CLOSE, Close(1000, "bye").serialize())
_P = {seed: _payload(size, seed) for seed, size in ((10, 10), (11, BIG + 4464), (12, BIG))}
_P |= {seed: _payload(size, seed) for seed, size in ((13, BIG - 1), (14, 100_000), (15, 5))}
_P |= {seed: _payload(size, seed) for seed, size in ((16, 80_000), (17, 1 << 20), (18, 3))}
# A small frame whose payload reads on the wire as the header of a large one: a reader
# that lost its place in the stream there would take what follows as that frame's.
_DECOY_WIRE = _frame(Opcode.BINARY, bytes(70_000))[:14]
DECOY = _frame(Opcode.BINARY, _DECOY_WIRE)[-14:]  # masking it again unmasks it
GOOD = [
    _frame(Opcode.BINARY, _P[10]),
    _frame(Opcode.BINARY, _P[11]),  # 64-bit length
    _frame(Opcode.BINARY, _P[12]),
    _frame(Opcode.BINARY, _P[13]),  # 16-bit length, just under
    _frame(Opcode.BINARY, DECOY),
    _frame(Opcode.PING, b"are you there"),
    _frame(Opcode.BINARY, _P[14], fin=False),
    _frame(Opcode.CONT, _P[15], fin=False),
    _frame(Opcode.CONT, _P[16]),
    _frame(Opcode.BINARY, _P[17]),
    _frame(Opcode.BINARY, _P[18]),
]
GOOD_MESSAGES = [_P[10], _P[11], _P[12], _P[13], DECOY]
GOOD_MESSAGES += [_P[14] + _P[15] + _P[16], _P[17], _P[18]]
GOOD_TAKEN = 5  # its data frames of ZERO_COPY_FROM bytes or more
# Each stream: its frames, and whether the client ends it by closing its side mid-way.
STREAMS: dict[str, tuple[list[bytes], int | None]] = {
    "good": (GOOD + [CLOSE], None),
    "over max_size": ([GOOD[0], _frame(Opcode.BINARY, _payload(MAX_SIZE + 1, 20))], None),
    "message over max_size": (
        [
            _frame(Opcode.BINARY, _payload(MAX_SIZE - BIG, 21), fin=False),
            _frame(Opcode.CONT, _payload(BIG + 1, 22)),
        ],
        None,
    ),
    "unmasked": ([GOOD[0], _frame(Opcode.BINARY, _payload(BIG, 23), masked=False)], None),
    "continuation first": ([_frame(Opcode.CONT, _payload(BIG, 24))], None),
    "new message inside a message": (
        [
            _frame(Opcode.BINARY, _payload(5, 25), fin=False),
            _frame(Opcode.BINARY, _payload(BIG, 26)),
        ],
        None,
    ),
    "reserved bit": ([_frame(Opcode.BINARY, _payload(BIG, 27), rsv1=True)], None),
    "large text": ([_frame(Opcode.TEXT, b"x" * BIG)], None),
    "large control frame": ([_frame(Opcode.PING, _payload(BIG, 28))], None),
    "ends inside a payload": ([GOOD[0], GOOD[1]], len(GOOD[0]) + 1000),
    "ends inside a header": ([GOOD[0], GOOD[1]], len(GOOD[0]) + 5),
    "ends after a header": ([GOOD[0], GOOD[1]], len(GOOD[0]) + 14),
}


def _cuts(frames: Sequence[bytes], how: str) -> list[int]:
    """Offsets in the stream of ``frames`` where the client waits for the server to
    have read everything before it sends on."""
    if how == "whole":
        return []
    cuts: list[int] = []
    start = 0
    for frame in frames:
        header = 2 + (2 if frame[1] & 0x7F == 126 else 8 if frame[1] & 0x7F == 127 else 0)
        header += 4 if frame[1] & 0x80 else 0
        if how == "frames":
            cuts.append(start)
        elif how == "headers":  # a header completed inside a read that goes on
            cuts += [start + 1, start + 3]
        else:  # "inside": after one byte, inside the length, the mask, the payload
            for at in (1, 2, 3, header - 2, header, header + 1, header + 1000):
                if at < len(frame):
                    cuts.append(start + at)
        start += len(frame)
    return sorted(set(c for c in cuts if 0 < c < start))


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
                outcome.digests.append(_digest(message))
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
    cuts = _cuts(frames, how)
    theirs, _ = await _play(ServerConnection, frames, cuts, end_at)
    ours, taken = await _play(ZeroCopyConnection, frames, cuts, end_at)
    assert ours == theirs
    if name == "good":
        assert taken == GOOD_TAKEN  # it kept its place in the stream throughout
        assert ours.digests == [_digest(m) for m in GOOD_MESSAGES]
        assert ours.closed == "clean" and ours.close_sent == (1000, "bye")
    else:
        assert ours.closed == "ConnectionClosedError"


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
