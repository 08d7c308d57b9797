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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

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


def _padded_header(header: dict[str, Any]) -> bytes:
    body = canonical_json(header)
    return body + b" " * ((-(_PREFIX.size + len(body))) % PAYLOAD_ALIGN)


def encode_frame(header: dict[str, Any], payload: Sequence[Buffer] = ()) -> bytes:
    """Build one wire message. ``payload`` parts are concatenated as given."""
    body = _padded_header(header)
    return b"".join([_PREFIX.pack(len(body)), body, *payload])


def allocate_frame(header: dict[str, Any], payload_len: int) -> tuple[memoryview, memoryview]:
    """A frame with ``header`` written and a writable payload of ``payload_len`` bytes,
    not initialised: the sender writes every byte of it.

    Lets a sender write tensors straight into the message (one copy, not two) and
    fill in header fields of fixed length afterwards with ``rewrite_header``. The
    memory comes from torch's allocator, which neither zeroes it first nor faults it in
    a page at a time (it asks for huge pages), where a bytearray would do both.
    """
    body = _padded_header(header)
    memory = torch.empty(_PREFIX.size + len(body) + payload_len, dtype=torch.uint8).numpy()
    frame = memoryview(memory)  # type: ignore[arg-type]  # an ndarray is a buffer
    _PREFIX.pack_into(frame, 0, len(body))
    frame[_PREFIX.size : _PREFIX.size + len(body)] = body
    return frame, frame[_PREFIX.size + len(body) :]


def rewrite_header(frame: memoryview, header: dict[str, Any]) -> None:
    """Replace the header of an allocated frame by one that encodes to the same length."""
    (old_len,) = _PREFIX.unpack_from(frame, 0)
    body = canonical_json(header)
    if len(body) > old_len:
        raise ValueError(f"new header is {len(body)} bytes; the frame has room for {old_len}")
    frame[_PREFIX.size : _PREFIX.size + old_len] = body + b" " * (old_len - len(body))


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
        header = json.loads(
            bytes(view[_PREFIX.size : end]).decode("utf-8"),
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
        )
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
