"""Reading a WebSocket connection's large frames straight into a buffer of their size,
for websockets' asyncio connections on either end (``FrameReads``).

websockets appends every chunk the socket returns to one growing buffer, slices each
frame's payload out of it (a copy, then a move of the rest), and unmasks the slice into
new bytes; a receiver then joins a message's frames into one more. ``FrameReads`` makes
a connection an ``asyncio.BufferedProtocol``: it reads each frame's header itself, and a
data frame of ``READ_DIRECT_FROM`` bytes or more is read by the socket (or the TLS
layer) straight into a buffer of its size, then unmasked (or, from a server, copied
once) into the bytes websockets hands on. A payload that came whole in one read is
unmasked or copied from where it lies. Every other frame, and everything before the
handshake ends, passes to websockets as it came, so the checks and errors on those are
websockets' own. It takes a frame only where websockets would accept it as it is
(masked from a client and unmasked from a server, no reserved bits or extensions, within
the size limits, a continuation only inside a message) and gives it to websockets'
protocol as a parsed frame.

It starts reading frames at the first read that begins at a frame's start with nothing
left in websockets' buffer. A peer that streams frames back to back from its handshake
on may never give one, and then websockets reads them all; Cleave's coordinator and
worker each wait for the other's answer in their handshake (challenge, hello, welcome),
and the read after such a wait begins at a frame's start.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from websockets.frames import Frame, Opcode
from websockets.protocol import Side, State
from websockets.streams import StreamReader

try:
    from websockets.speedups import apply_mask
except ImportError:  # websockets built without its C extension
    from websockets.utils import apply_mask

# Frames from this size on are read into a buffer of their own: below it, the buffer
# costs more than the copies it saves.
READ_DIRECT_FROM = 1 << 16
# What the socket is read into between large payloads (asyncio's own read size).
CHUNK = 1 << 18
# Payload buffers kept for reuse per thread (a fresh one is faulted in page by page), and
# the largest kept: a rare huge frame must not hold its memory for good.
KEPT_BUFFERS = 4
KEPT_UP_TO = 16 << 20


def header_extent(data: bytes | bytearray | memoryview, at: int = 0) -> tuple[int, int | None]:
    """The length of the frame header that starts at ``data[at]``, and its payload's
    length (None while ``data`` ends before the header does)."""
    if len(data) - at < 2:
        return 2, None
    second = data[at + 1]
    length = second & 0x7F
    size = 2 + (2 if length == 126 else 8 if length == 127 else 0) + (4 if second & 0x80 else 0)
    if len(data) - at < size:
        return size, None
    if length == 126:
        (length,) = struct.unpack_from("!H", data, at + 2)
    elif length == 127:
        (length,) = struct.unpack_from("!Q", data, at + 2)
    return size, length


class _Buffers(threading.local):
    """Per event-loop thread: the chunk the socket is read into, and payload buffers
    kept for reuse (their memory is faulted in already). A pool, not a
    ``common.scratch.Scratch``: several connections may each be midway through a payload,
    and only a few buffers are kept, whatever the number of connections."""

    def __init__(self) -> None:
        # A view, never the bytearray itself: asyncio's TLS layer fills the rest of a
        # read buffer through a slice of it, and a bytearray's slice is a copy.
        self.chunk = memoryview(bytearray(CHUNK))
        # While a read of ``chunk`` is handled: a read nested in that (TLS reads what
        # is left when websockets closes the transport) gets a chunk of its own.
        self.lent = False
        self.kept: list[np.ndarray] = []

    def take(self, size: int) -> np.ndarray:
        fits = [i for i, kept in enumerate(self.kept) if len(kept) >= size]
        if fits:  # the smallest that fits
            return self.kept.pop(min(fits, key=lambda i: len(self.kept[i])))
        # Not a bytearray, which zeroes all its memory at once: a header alone would make
        # the process hold what its frame says it will carry. This one's pages are held
        # as the payload arrives, as websockets' own buffer grows.
        return np.empty(size, dtype=np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        if len(buffer) > KEPT_UP_TO:
            return
        self.kept.append(buffer)
        if len(self.kept) > KEPT_BUFFERS:
            self.kept.pop(min(range(len(self.kept)), key=lambda i: len(self.kept[i])))


_BUFFERS = _Buffers()


# What _take and _room read of websockets' protocol, besides its state and extensions.
_PROTOCOL_STATE = ("current_size", "max_message_size", "max_fragment_size", "parser", "reader")


@dataclass(slots=True)
class _Payload:
    """A large frame's payload being read into ``memory``."""

    head: bytes  # the frame's header: its last four bytes are the mask, if it is masked
    length: int
    memory: np.ndarray | None  # None: the payload came whole in one read, ``view`` is there
    view: memoryview
    filled: int = 0


class FrameReads(asyncio.BufferedProtocol):
    """Mixed into a websockets asyncio connection ahead of it:
    ``class C(FrameReads, ServerConnection)``. Its ``__init__`` runs the connection's
    and then sets up its own state."""

    if TYPE_CHECKING:  # what it uses of websockets' Connection
        protocol: Any  # a ServerProtocol or a ClientProtocol
        debug: bool
        logger: Any

        def data_received(self, data: bytes) -> None: ...

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # None until the stream is at a frame's start after the handshake, then whether
        # this class reads the frames.
        self._framing: bool | None = None
        self._head = bytearray()  # a header split across reads
        self._passing = 0  # bytes of the current frame still to hand to websockets
        self._payload: _Payload | None = None
        self._direct = False  # whether get_buffer handed out the payload's own memory
        self._chunk = _BUFFERS.chunk  # what the last get_buffer handed out

    # ---- asyncio.BufferedProtocol ------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        payload = self._payload
        # The rest of a large payload is read where it goes. A short rest is read into
        # the chunk with what follows it, and copied: one system call, not two.
        self._direct = payload is not None and payload.length - payload.filled >= CHUNK
        if payload is not None and self._direct:
            return payload.view[payload.filled :]
        self._chunk = memoryview(bytearray(CHUNK)) if _BUFFERS.lent else _BUFFERS.chunk
        return self._chunk

    def buffer_updated(self, nbytes: int) -> None:
        payload = self._payload
        if payload is not None and self._direct:
            payload.filled += nbytes
            if payload.filled == payload.length:
                self._deliver(payload)
            return
        chunk = self._chunk
        shared = chunk is _BUFFERS.chunk
        _BUFFERS.lent |= shared
        try:
            data = chunk[:nbytes]
            if payload is not None:
                taken = min(nbytes, payload.length - payload.filled)
                payload.view[payload.filled : payload.filled + taken] = data[:taken]
                payload.filled += taken
                if payload.filled < payload.length:
                    return
                self._deliver(payload)
                data = data[taken:]
            if self._framing is None and self.protocol.state is not State.CONNECTING:
                self._framing = self._at_frame_start()
            if self._framing:
                self._split(data)
            elif data:
                self.data_received(bytes(data))
        finally:
            if shared:
                _BUFFERS.lent = False

    def eof_received(self) -> None:
        self._hand_over_partial()
        super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._hand_over_partial()
        super().connection_lost(exc)

    # ---- framing ---------------------------------------------------------------------

    def _at_frame_start(self) -> bool | None:
        """Whether websockets' parser waits for a frame's first byte with nothing
        buffered: then this class reads from this read on. None while it does not yet
        (a frame arrived with the handshake's last bytes, or began in them), to ask
        again at the next read; False for good once the connection closes, or where
        websockets' protocol is not laid out as this class expects (websockets before
        the limits ``_room`` reads): there websockets reads every frame."""
        protocol = self.protocol
        if protocol.state is not State.OPEN or not all(
            hasattr(protocol, name) for name in _PROTOCOL_STATE
        ):
            return False
        if protocol.reader.buffer:
            return None
        parser: Any = protocol.parser
        while getattr(parser, "gi_yieldfrom", None) is not None:
            parser = parser.gi_yieldfrom
        return True if getattr(parser, "gi_code", None) is StreamReader.at_eof.__code__ else None

    def _split(self, data: memoryview) -> None:
        """Hand websockets what it reads itself, in runs, and start reading a large
        frame's payload where one begins. A small frame is skipped over whole: only its
        header is looked at."""
        end = len(data)
        run = 0  # data[run:at] is websockets'
        if self._head:
            start = self._finish_head(data)
            if start is None:
                return
            run = start
        at = run + self._passing  # past the rest of a frame websockets is reading
        self._passing = 0
        while at < end:
            size, length = header_extent(data, at)
            if length is None:  # the header goes on in the next read
                if run < at:
                    self._feed(data[run:at])
                self._head = bytearray(data[at:end])
                return
            if length >= READ_DIRECT_FROM:
                if run < at:
                    self._feed(data[run:at])
                run = at
                if self._take(data[at : at + size].tobytes(), length, data, at + size):
                    at = run = min(end, at + size + length)
                    continue
            at += size + length
        self._passing = at - end if at > end else 0
        if run < end:
            self._feed(data[run:end])

    def _finish_head(self, data: memoryview) -> int | None:
        """Complete the header begun in an earlier read from the start of ``data``, and
        take its frame or hand the header to websockets; where in ``data`` what follows
        the header's frame begins (``_passing`` says how much of it is websockets'), or
        None when ``data`` ended first."""
        head = self._head
        at = 0
        while True:
            size, length = header_extent(head)
            if length is not None:
                break
            if at == len(data):
                return None
            take = min(size - len(head), len(data) - at)
            head += data[at : at + take]
            at += take
        self._head = bytearray()
        if self._take(bytes(head), length, data, at):
            return min(len(data), at + length)
        self.data_received(bytes(head))
        self._passing = length
        return at

    def _feed(self, data: memoryview) -> None:
        # websockets appends what it is given to its own buffer: a view of the chunk
        # read will do.
        self.data_received(data)  # type: ignore[arg-type]

    def _take(self, head: bytes, length: int, data: memoryview, at: int) -> bool:
        """Start reading the payload of the frame ``head`` heads (the part of it that
        ``data[at:]`` holds is copied in now), if it is one for this class to read:
        large, a data frame, and one websockets would accept."""
        protocol = self.protocol
        first, second = head[0], head[1]
        opcode = first & 0x0F
        if (
            length < READ_DIRECT_FROM
            or protocol.state is not State.OPEN
            or protocol.extensions
            or first & 0x70  # reserved bits
            or bool(second & 0x80) != (protocol.side is Side.SERVER)  # only a client masks
            or opcode not in (Opcode.BINARY, Opcode.CONT)
            or (opcode == Opcode.CONT) != (protocol.current_size is not None)
            or length > self._room()
        ):
            if protocol.state is not State.OPEN:
                self._framing = False  # closing: the rest is websockets'
            return False
        if len(data) - at >= length:  # all in this read: unmasked or copied from there
            self._deliver(_Payload(head, length, None, data[at : at + length], length))
            return True
        memory = _BUFFERS.take(length)
        payload = _Payload(head, length, memory, memory.data[:length])
        payload.view[: len(data) - at] = data[at:]
        payload.filled = len(data) - at
        self._payload = payload
        return True

    def _room(self) -> int:
        """The largest payload websockets would accept now (as its parser works it out)."""
        protocol = self.protocol
        room = 1 << 63
        if protocol.max_message_size is not None:
            room = protocol.max_message_size - (protocol.current_size or 0)
        if protocol.max_fragment_size is not None:
            room = min(room, protocol.max_fragment_size)
        return room

    def _deliver(self, payload: _Payload) -> None:
        self._payload = None
        head = payload.head
        # A client's frame is unmasked into new bytes; a server's is copied into them
        # once (websockets' receiver then hands a one-frame message on as it is).
        data = apply_mask(payload.view, head[-4:]) if head[1] & 0x80 else bytes(payload.view)
        if payload.memory is not None:
            _BUFFERS.give(payload.memory)
        frame = Frame(Opcode(head[0] & 0x0F), data, bool(head[0] & 0x80))
        if self.debug:
            self.logger.debug("< %s", frame)
        # _take checked all that recv_frame would raise for on a data frame.
        self.protocol.recv_frame(frame)
        # websockets' own handling of what the frame produced, as after any read.
        self.data_received(b"")

    def _hand_over_partial(self) -> None:
        """At the end of the stream, give websockets what it has not seen of a frame cut
        short, so that it ends the connection as it would have."""
        partial: bytes | bytearray = self._head
        if (payload := self._payload) is not None and payload.memory is not None:
            partial = payload.head + payload.view[: payload.filled]
            _BUFFERS.give(payload.memory)
        self._payload = None
        self._head = bytearray()
        self._framing = False
        if partial and not self.protocol.reader.eof:
            self.protocol.receive_data(partial)
