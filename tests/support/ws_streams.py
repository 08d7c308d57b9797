"""Raw WebSocket byte streams for the frame reader's tests (tests/loopback/
test_zero_copy_reads.py from a client, test_client_frame_reads.py from a server):
frames laid out by hand, also ones websockets would refuse to build, and the places to
cut a stream at."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from websockets.frames import Close, Opcode


def payload(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def digest(message: bytes | str) -> str:
    return hashlib.sha256(message if isinstance(message, bytes) else message.encode()).hexdigest()


def sized_messages(big: int) -> list[bytes | list[bytes]]:
    """Whole messages on both sides of the sizes where the length field changes form and
    where payloads start to be read directly (``big``), and fragmented messages whose
    fragments are large, small and mixed."""
    sizes = (0, 1, 125, 126, 65535, big - 1, big, big + 1, (1 << 20) + 3, 3 << 20)
    messages: list[bytes | list[bytes]] = [payload(n, n) for n in sizes]
    messages.append([payload(big + 5, 1), payload(7, 2), payload(3 * big, 3)])
    messages.append([payload(10, 4), payload(big, 5)])
    messages.append([payload(2 * big, 6), payload(big, 7)])
    return messages


def joined_digest(message: bytes | list[bytes]) -> str:
    """The digest of what a message sent as it is, or as these fragments, arrives as."""
    return digest(message if isinstance(message, bytes) else b"".join(message))


def frame(
    opcode: Opcode, data: bytes, fin: bool = True, *, masked: bool, rsv1: bool = False
) -> bytes:
    """A frame as RFC 6455 §5.2 lays it out, also one websockets would refuse to build
    (its serializer checks frames first)."""
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


def cuts(frames: Sequence[bytes], how: str) -> list[int]:
    """Offsets in the stream of ``frames`` where the sender waits for the receiver to
    have read everything before it sends on: none ("whole"), at each frame ("frames"),
    twice in each header ("headers"), or after one byte and inside the length, the mask
    and the payload ("inside")."""
    if how == "whole":
        return []
    found: list[int] = []
    start = 0
    for wire in frames:
        header = 2 + (2 if wire[1] & 0x7F == 126 else 8 if wire[1] & 0x7F == 127 else 0)
        header += 4 if wire[1] & 0x80 else 0
        if how == "frames":
            found.append(start)
        elif how == "headers":  # a header completed inside a read that goes on
            found += [start + 1, start + 3]
        else:
            for at in (1, 2, 3, header - 2, header, header + 1, header + 1000):
                if at < len(wire):
                    found.append(start + at)
        start += len(wire)
    return sorted(set(c for c in found if 0 < c < start))


GOOD_TAKEN = 5  # the good stream's data frames of 64 KiB or more


@dataclass(frozen=True)
class Streams:
    """One side's byte streams: each stream's frames and where the sender hangs up inside
    it (None: at its end), what the good stream's messages are, and its payloads by seed."""

    streams: dict[str, tuple[list[bytes], int | None]]
    good_messages: list[bytes]
    payloads: dict[int, bytes]
    close: bytes


def streams(*, masked: bool, big: int, max_size: int) -> Streams:
    """The streams a client (``masked``) or a server sends: one good, and one for each
    way websockets refuses a stream or sees it cut short, around a reader's threshold
    ``big`` and the receiver's ``max_size``."""

    def side(opcode: Opcode, data: bytes, fin: bool = True, *, rsv1: bool = False) -> bytes:
        return frame(opcode, data, fin, masked=masked, rsv1=rsv1)

    p = {seed: payload(size, seed) for seed, size in ((10, 10), (11, big + 4464), (12, big))}
    p |= {seed: payload(size, seed) for seed, size in ((13, big - 1), (14, 100_000), (15, 5))}
    p |= {seed: payload(size, seed) for seed, size in ((16, 80_000), (17, 1 << 20), (18, 3))}
    # A small frame whose payload reads on the wire as the header of a large one: a
    # reader that lost its place in the stream there would take what follows as that
    # frame's. (Masking a masked payload again unmasks it.)
    head = 14 if masked else 10
    decoy = side(Opcode.BINARY, side(Opcode.BINARY, bytes(70_000))[:head])[-head:]
    good = [
        side(Opcode.BINARY, p[10]),
        side(Opcode.BINARY, p[11]),  # 64-bit length
        side(Opcode.BINARY, p[12]),
        side(Opcode.BINARY, p[13]),  # 16-bit length, just under
        side(Opcode.BINARY, decoy),
        side(Opcode.PING, b"are you there"),
        side(Opcode.BINARY, p[14], fin=False),
        side(Opcode.CONT, p[15], fin=False),
        side(Opcode.CONT, p[16]),
        side(Opcode.BINARY, p[17]),
        side(Opcode.BINARY, p[18]),
    ]
    messages = [p[10], p[11], p[12], p[13], decoy, p[14] + p[15] + p[16], p[17], p[18]]
    close = side(Opcode.CLOSE, Close(1000, "bye").serialize())
    wrong = frame(Opcode.BINARY, payload(big, 23), masked=not masked)
    table: dict[str, tuple[list[bytes], int | None]] = {
        "good": (good + [close], None),
        "over max_size": ([good[0], side(Opcode.BINARY, payload(max_size + 1, 20))], None),
        "message over max_size": (
            [
                side(Opcode.BINARY, payload(max_size - big, 21), fin=False),
                side(Opcode.CONT, payload(big + 1, 22)),
            ],
            None,
        ),
        "unmasked" if masked else "masked": ([good[0], wrong], None),
        "continuation first": ([side(Opcode.CONT, payload(big, 24))], None),
        "new message inside a message": (
            [side(Opcode.BINARY, payload(5, 25), fin=False), side(Opcode.BINARY, payload(big, 26))],
            None,
        ),
        "reserved bit": ([side(Opcode.BINARY, payload(big, 27), rsv1=True)], None),
        "large text": ([side(Opcode.TEXT, b"x" * big)], None),
        "large control frame": ([side(Opcode.PING, payload(big, 28))], None),
        "ends inside a payload": ([good[0], good[1]], len(good[0]) + 1000),
        "ends inside a header": ([good[0], good[1]], len(good[0]) + 5),
        "ends after a header": ([good[0], good[1]], len(good[0]) + head),
    }
    return Streams(table, messages, p, close)


def assert_ends_alike(
    name: str, ours: Any, theirs: Any, taken: int, good_messages: Sequence[bytes]
) -> None:
    """A stream's outcome on Cleave's connection (``ours``: digests, how the receiving
    end's recv ended, the close it sent) is websockets' own; on the good stream the
    reader took ``GOOD_TAKEN`` frames, every message arrived and the close was clean."""
    assert ours == theirs
    if name == "good":
        assert taken == GOOD_TAKEN  # it kept its place in the stream throughout
        assert ours.digests == [digest(m) for m in good_messages]
        assert ours.closed == "clean" and ours.close_sent == (1000, "bye")
    else:
        assert ours.closed == "ConnectionClosedError"
