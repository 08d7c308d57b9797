"""Outer frame codec: layout, canonical JSON, and every malformed input it must refuse."""

from __future__ import annotations

import json
import struct

import pytest

from common.errors import FrameError, LimitExceeded, ProtocolError
from common.frames import PAYLOAD_ALIGN, Frame, canonical_json, decode_frame, encode_frame
from common.limits import WireLimits


def _raw_frame(header_bytes: bytes, payload: bytes = b"") -> bytes:
    """A frame with exactly these header bytes (no canonicalisation, no padding)."""
    return struct.pack(">I", len(header_bytes)) + header_bytes + payload


# ---- round trip and layout ---------------------------------------------------------


def test_round_trip_header_and_payload() -> None:
    header = {"type": "hello", "v": 1, "name": "w1", "nested": {"a": [1, 2.5, None, True]}}
    frame = decode_frame(encode_frame(header, [b"abc", b"", bytearray(b"def")]))
    assert isinstance(frame, Frame)
    assert frame.header == header
    assert frame.type == "hello"
    assert bytes(frame.payload) == b"abcdef"


def test_round_trip_without_payload() -> None:
    frame = decode_frame(encode_frame({"type": "resume", "v": 1}))
    assert frame.header == {"type": "resume", "v": 1}
    assert len(frame.payload) == 0


@pytest.mark.parametrize("extra", ["", "x", "x" * 59, "x" * 60, "x" * 61, "x" * 200])
def test_payload_starts_on_a_64_byte_boundary(extra: str) -> None:
    data = encode_frame({"type": "t", "v": 1, "pad": extra}, [b"\x01\x02"])
    (header_len,) = struct.unpack_from(">I", data, 0)
    payload_start = 4 + header_len
    assert payload_start % PAYLOAD_ALIGN == 0
    assert data[payload_start:] == b"\x01\x02"
    # padding is whitespace after the JSON, so the header still parses as-is
    assert json.loads(data[4:payload_start]) == {"type": "t", "v": 1, "pad": extra}
    # and decode_frame's payload view is the same bytes
    assert bytes(decode_frame(data).payload) == b"\x01\x02"


def test_payload_view_is_zero_copy() -> None:
    data = bytearray(encode_frame({"type": "t", "v": 1}, [b"\x00" * 8]))
    frame = decode_frame(data)
    data[-1] = 0x7F
    assert frame.payload[-1] == 0x7F


def test_decode_accepts_bytes_bytearray_and_memoryview() -> None:
    data = encode_frame({"type": "t", "v": 1}, [b"xyz"])
    for buf in (data, bytearray(data), memoryview(data)):
        frame = decode_frame(buf)
        assert frame.header["type"] == "t"
        assert bytes(frame.payload) == b"xyz"


def test_canonical_json_is_deterministic() -> None:
    a = {"b": 1, "a": {"z": [1, 2], "y": "é"}, "c": 0.5}
    b = {"c": 0.5, "a": {"y": "é", "z": [1, 2]}, "b": 1}
    assert canonical_json(a) == canonical_json(b)
    assert canonical_json(a) == b'{"a":{"y":"\\u00e9","z":[1,2]},"b":1,"c":0.5}'
    # pure ASCII, no spaces
    assert canonical_json(a).decode("ascii")
    assert b" " not in canonical_json(a)


def test_canonical_json_refuses_nan() -> None:
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_encode_is_deterministic_regardless_of_key_order() -> None:
    first = encode_frame({"v": 1, "type": "t", "a": 2})
    assert first == encode_frame({"a": 2, "type": "t", "v": 1})


# ---- malformed frames ----------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"\x00", b"\x00\x00\x00"])
def test_short_prefix(data: bytes) -> None:
    with pytest.raises(FrameError, match="shorter than its 4-byte length prefix"):
        decode_frame(data)


def test_header_length_past_end() -> None:
    data = struct.pack(">I", 100) + b'{"type":"t","v":1}'
    with pytest.raises(FrameError, match="runs past the end"):
        decode_frame(data)


def test_header_too_large_for_limit() -> None:
    limits = WireLimits(max_frame_bytes=1 << 20, max_header_bytes=32)
    data = encode_frame({"type": "t", "v": 1, "pad": "x" * 64})
    with pytest.raises(LimitExceeded, match="max_header_bytes=32"):
        decode_frame(data, limits)
    # the prefix alone is enough: a huge declared length is refused before reading it
    with pytest.raises(LimitExceeded, match="max_header_bytes"):
        decode_frame(struct.pack(">I", 0xFFFFFFFF))


def test_frame_too_large_for_limit() -> None:
    limits = WireLimits(max_frame_bytes=256, max_header_bytes=128)
    data = encode_frame({"type": "t", "v": 1}, [b"\0" * 300])
    with pytest.raises(LimitExceeded, match="max_frame_bytes=256"):
        decode_frame(data, limits)
    # exactly at the limit is fine
    ok = encode_frame({"type": "t", "v": 1}, [b"\0" * (256 - 64)])
    assert len(ok) == 256
    assert decode_frame(ok, limits).header["type"] == "t"


def test_limit_exceeded_is_a_protocol_error_with_a_code() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_frame(struct.pack(">I", 0xFFFFFFFF))
    assert info.value.code == "limit_exceeded"
    with pytest.raises(ProtocolError) as info:
        decode_frame(b"")
    assert info.value.code == "bad_frame"


def test_limits_must_be_consistent() -> None:
    with pytest.raises(ValueError):
        WireLimits(max_frame_bytes=10, max_header_bytes=10)


@pytest.mark.parametrize(
    "header_bytes",
    [
        b'{"type":"t","v":1,"x":"\xff"}',  # invalid UTF-8
        b"\xc3\x28",
        b"\xef\xbb\xbf{}",  # BOM
    ],
)
def test_header_not_utf8(header_bytes: bytes) -> None:
    with pytest.raises(FrameError, match="not valid UTF-8 JSON"):
        decode_frame(_raw_frame(header_bytes))


@pytest.mark.parametrize(
    "header_bytes",
    [b"", b"   ", b"{", b'{"type":"t","v":1', b"{'type':'t'}", b"hello", b'{"a":1}{"b":2}'],
)
def test_header_not_json(header_bytes: bytes) -> None:
    with pytest.raises(FrameError, match="not valid UTF-8 JSON"):
        decode_frame(_raw_frame(header_bytes))


def test_deeply_nested_header_is_a_frame_error() -> None:
    depth = 30_000
    header = b'{"type":"t","v":1,"x":' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(FrameError):
        decode_frame(_raw_frame(header))


def test_huge_integer_literal_is_a_frame_error() -> None:
    header = b'{"type":"t","v":' + b"9" * 5000 + b"}"
    with pytest.raises(FrameError):
        decode_frame(_raw_frame(header))


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e999"])
def test_non_finite_numbers_are_refused(literal: bytes) -> None:
    # canonical_json (what signatures cover) cannot represent them, so the frame
    # codec must not let them in either
    header = b'{"type":"t","v":1,"x":' + literal + b"}"
    with pytest.raises(FrameError, match="non-finite"):
        decode_frame(_raw_frame(header))


@pytest.mark.parametrize("header", [[], "t", 1, None, True, [{"type": "t", "v": 1}]])
def test_header_not_an_object(header: object) -> None:
    with pytest.raises(FrameError, match="must be a JSON object"):
        decode_frame(_raw_frame(json.dumps(header).encode()))


@pytest.mark.parametrize(
    "header",
    [
        {"v": 1},
        {"type": "", "v": 1},
        {"type": None, "v": 1},
        {"type": 3, "v": 1},
        {"type": ["t"], "v": 1},
        {"type": True, "v": 1},
    ],
)
def test_missing_or_empty_type(header: dict[str, object]) -> None:
    with pytest.raises(FrameError, match='non-empty string "type"'):
        decode_frame(encode_frame(header))


@pytest.mark.parametrize(
    "header",
    [
        {"type": "t"},
        {"type": "t", "v": "1"},
        {"type": "t", "v": 1.0},
        {"type": "t", "v": True},
        {"type": "t", "v": False},
        {"type": "t", "v": None},
        {"type": "t", "v": [1]},
    ],
)
def test_missing_or_non_int_version(header: dict[str, object]) -> None:
    with pytest.raises(FrameError, match='integer protocol version "v"'):
        decode_frame(encode_frame(header))


def test_error_messages_carry_the_message_property() -> None:
    with pytest.raises(FrameError) as info:
        decode_frame(b"\x00")
    assert info.value.message == str(info.value)
    assert "4-byte" in info.value.message
