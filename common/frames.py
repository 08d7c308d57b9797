"""Outer frame of every protocol message.

``u32 header length (big endian) | header (UTF-8 JSON object) | payload``

The header is padded with spaces so the payload starts on a 64-byte boundary of the
frame: tensors placed at aligned payload offsets can then be viewed in place
(``torch.frombuffer``) without a copy on the receiving side.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from common.errors import FrameError, LimitExceeded
from common.limits import DEFAULT_LIMITS, WireLimits

PAYLOAD_ALIGN = 64
_PREFIX = struct.Struct(">I")

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    payload: memoryview

    @property
    def type(self) -> str:
        return str(self.header["type"])


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON: what signatures are computed over, on both sides."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name} is not JSON")


def _finite_float(text: str) -> float:
    # NaN/Infinity (and literals like 1e400 that overflow to inf) are refused: canonical_json,
    # which signatures are computed over, cannot represent them, and no field needs them.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"non-finite number {text[:32]} is not allowed")
    return value


# One decoder for every header: ``json.loads`` with hooks builds a new decoder and its
# scanner on each call, which cost as much as decoding a small header.
_HEADER_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def frame_head(header: dict[str, Any]) -> bytes:
    """A frame's bytes before its payload: the length prefix and the padded header."""
    return head_of(canonical_json(header))


def head_of(body: bytes) -> bytes:
    """``frame_head`` of a header already serialised as a JSON object."""
    body += b" " * (head_length(len(body)) - _PREFIX.size - len(body))
    return _PREFIX.pack(len(body)) + body


def head_length(body_bytes: int) -> int:
    """The length of ``head_of`` a header of this many bytes."""
    return body_bytes + _PREFIX.size + (-(_PREFIX.size + body_bytes)) % PAYLOAD_ALIGN


def encode_frame(header: dict[str, Any], payload: Sequence[Buffer] = ()) -> bytes:
    """Build one wire message. ``payload`` parts are concatenated as given."""
    return b"".join([frame_head(header), *payload])


class FrameParts:
    """One wire message held as the consecutive buffers it is made of (its head, then
    payload parts), so that operand blocks shared by many tasks are never copied into
    each task's frame. The server writes the parts one after another as the payload of
    one WebSocket frame; the receiver gets the joined bytes, exactly as if it had been
    one buffer.
    """

    __slots__ = ("parts", "_nbytes")

    def __init__(self, parts: Sequence[Buffer]) -> None:
        self.parts = tuple(p for p in parts if memoryview(p).nbytes)  # no empty fragments
        self._nbytes = sum(memoryview(p).nbytes for p in self.parts)

    def __len__(self) -> int:
        return self._nbytes

    def __iter__(self) -> Iterator[Buffer]:
        return iter(self.parts)

    def join(self) -> bytes:
        return b"".join(self.parts)


def decode_frame(data: Buffer, limits: WireLimits = DEFAULT_LIMITS) -> Frame:
    """Split a wire message into its header and a zero-copy view of its payload.

    Raises FrameError or LimitExceeded only.
    """
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    if len(view) > limits.max_frame_bytes:
        raise LimitExceeded(
            f"frame of {len(view)} bytes exceeds max_frame_bytes={limits.max_frame_bytes}"
        )
    if len(view) < _PREFIX.size:
        raise FrameError(f"frame of {len(view)} bytes is shorter than its 4-byte length prefix")
    (header_len,) = _PREFIX.unpack_from(view, 0)
    if header_len > limits.max_header_bytes:
        raise LimitExceeded(
            f"header of {header_len} bytes exceeds max_header_bytes={limits.max_header_bytes}"
        )
    end = _PREFIX.size + header_len
    if end > len(view):
        raise FrameError(
            f"header length {header_len} runs past the end of a {len(view)}-byte frame"
        )
    try:
        header = _HEADER_DECODER.decode(bytes(view[_PREFIX.size : end]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError(f"header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise FrameError("header must be a JSON object")
    msg_type = header.get("type")
    if not isinstance(msg_type, str) or not msg_type:
        raise FrameError('header needs a non-empty string "type"')
    if not isinstance(header.get("v"), int) or isinstance(header.get("v"), bool):
        raise FrameError('header needs an integer protocol version "v"')
    return Frame(header=header, payload=view[end:])
