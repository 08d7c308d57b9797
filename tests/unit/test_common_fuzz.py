"""Hostile input: every decoder in common/ may raise ProtocolError subclasses and nothing else.

No KeyError, TypeError, ValueError, RecursionError, OverflowError, MemoryError, ...: a
peer that sends garbage gets an error reply with a code, and the receiving side survives.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import PROTOCOL_VERSION
from common.auth import check_hello, check_welcome
from common.errors import ProtocolError
from common.frames import decode_frame, encode_frame
from common.limits import DEFAULT_LIMITS, WireLimits
from common.messages import (
    MESSAGE_TYPES,
    Challenge,
    DeviceProfile,
    Error,
    Hello,
    Received,
    Task,
    Welcome,
    check_operands,
    encode_message,
    encode_task,
    parse_message,
    verify_task,
)
from common.signing import generate_private_key, public_key_hex, verify_bundle
from common.tensors import DTYPES, decode_tensors
from common.unfold import Unfold

FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

KEY = generate_private_key()
PUB = KEY.public_key()
SMALL_LIMITS = WireLimits(
    max_frame_bytes=1 << 16, max_header_bytes=1 << 12, max_dim=64, max_tensor_elements=4096
)

# ---- strategies -----------------------------------------------------------------------

EDGE_INTS = [
    0,
    1,
    -1,
    2,
    63,
    64,
    65,
    2**24,
    2**24 + 1,
    2**27,
    2**31,
    2**32,
    2**62,
    2**63,
    2**64,
    -(2**63),
    10**30,
    10**300,
    -(10**4000),
]
EDGE_FLOATS = [0.0, -0.0, 0.5, 1.0, 1e-320, 1e18, 1e308, -1e308, 5e-324]

json_ints = st.integers() | st.sampled_from(EDGE_INTS)
json_floats = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(EDGE_FLOATS)
json_scalars = st.none() | st.booleans() | json_ints | json_floats | st.text(max_size=12)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=25,
)
# Python-side values a direct caller could pass (not all of these survive JSON)
py_weird = st.sampled_from(
    [float("nan"), float("inf"), float("-inf"), -0.0, True, False, None, b"x", (1, 2), {1, 2}]
)

FIELD_NAMES = sorted(
    {
        "name",
        "profile",
        "window",
        "client",
        "worker_id",
        "coordinator_key",
        "heartbeat_interval_s",
        "max_frame_bytes",
        "job",
        "tile_id",
        "op",
        "tensors",
        "sig",
        "compute_s",
        "seq",
        "state",
        "in_flight",
        "reason",
        "credit_tiles",
        "credit_gflop",
        "code",
        "message",
        "nonce",
        "token_required",
        "worker_key",
        "token_proof",
    }
)
PROFILE_FIELDS = ["device", "device_name", "threads", "ram_bytes", "mem_cap_bytes", "gflops"]
DTYPE_NAMES = [*DTYPES, "int64", "bool", "uint8", ""]

plausible_scalars = (
    st.sampled_from(
        [
            "cpu",
            "cuda",
            "mm",
            "bmm",
            "working",
            "idle",
            "paused",
            "a",
            "b",
            "",
            "x" * 257,
            "\ud800" * 300,
            "é" * 5000,
            "float32",
            "bfloat16",
        ]
    )
    | st.integers(-2, 70)
    | json_ints
    | json_floats
    | st.booleans()
    | st.none()
)
dims = st.integers(-1, 6) | st.sampled_from([2**24, 2**24 + 1, 2**62, 10**30]) | json_scalars


@st.composite
def descriptors(draw: st.DrawFn, weird: bool = False) -> Any:
    """A tensor descriptor: mostly plausible, sometimes anything at all."""
    extra = py_weird if weird else st.nothing()
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values | extra)
    fields = {
        "name": st.sampled_from(["a", "b", "c", "", "x" * 300]) | json_scalars | extra,
        "dtype": st.sampled_from([*DTYPE_NAMES, "d" * 20_000]) | json_values | extra,
        "shape": st.lists(dims | extra, max_size=6) | json_values | extra,
        "offset": st.sampled_from([0, 1, 2, 64, 128, 4096]) | json_ints | json_scalars | extra,
        "nbytes": st.sampled_from([0, 2, 4, 8, 16, 64]) | json_ints | json_scalars | extra,
    }
    return draw(st.fixed_dictionaries({}, optional=fields))


def _header_values(name: str) -> st.SearchStrategy[Any]:
    if name == "profile":
        return st.dictionaries(st.sampled_from(PROFILE_FIELDS), plausible_scalars) | json_values
    if name == "tensors":
        return st.lists(descriptors(), max_size=10) | json_values
    return plausible_scalars | json_values


@st.composite
def headers(draw: st.DrawFn) -> dict[str, Any]:
    header: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(FIELD_NAMES), max_size=10, unique=True)):
        header[name] = draw(_header_values(name))
    header.update(draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3)))
    if draw(st.integers(0, 9)):  # usually a real type, so validation gets exercised
        header["type"] = draw(st.sampled_from(sorted(MESSAGE_TYPES)))
    else:
        header["type"] = draw(json_values)
    header["v"] = 1 if draw(st.integers(0, 9)) else draw(json_values)
    return header


def _task_frames() -> list[bytes]:
    g = torch.Generator().manual_seed(0)
    frames = []
    for op, a_shape, b_shape in [
        ("mm", (3, 5), (5, 2)),
        ("bmm", (2, 3, 4), (2, 4, 1)),
        ("mm", (1, 0), (0, 1)),
    ]:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            a = torch.randn(a_shape, generator=g).to(dtype)
            b = torch.randn(b_shape, generator=g).to(dtype)
            frames.append(bytes(encode_task(f"g0/{op}", op, a, b, KEY)))
    # Convolution tiles: an image block with its unfold spec, as operand a and as b.
    image = torch.randn(2, 3, 4, 5, generator=g)
    spec = Unfold("a", (3, 3), (1, 2), (1, 0), (1, 1))
    rows, cols = spec.matrix_shape(image.shape)
    frames.append(bytes(encode_task("g0/ua", "mm", image, torch.randn(cols, 2), KEY, unfold=spec)))
    spec_b = Unfold("b", (2, 2), (1, 1), (0, 0), (2, 1))
    rows, _ = spec_b.matrix_shape(image.shape)
    frames.append(
        bytes(encode_task("g0/ub", "mm", torch.randn(3, rows), image, KEY, unfold=spec_b))
    )
    return frames


TASK_FRAMES = _task_frames()


# ---- the property every decoder must keep ------------------------------------------------


def _check_reply(exc: ProtocolError) -> None:
    """The error reply a receiver builds from any ProtocolError is itself a valid message."""
    assert exc.code and len(exc.message) <= DEFAULT_LIMITS.max_message_chars
    reply = Error(code=exc.code, message=exc.message)
    assert parse_message(encode_message(reply)).message == reply


def _exercise(data: bytes | bytearray | memoryview, limits: WireLimits | None = None) -> None:
    """Run everything a receiver runs on a message; only ProtocolError may escape."""
    try:
        received = parse_message(data) if limits is None else parse_message(data, limits)
    except ProtocolError as exc:
        _check_reply(exc)
        return
    try:
        tensors = received.tensors() if limits is None else received.tensors(limits)
    except ProtocolError as exc:
        _check_reply(exc)
        tensors = None
    if isinstance(received.message, Task):
        if tensors is not None:
            try:
                check_operands(received.message.op, tensors, unfold=received.message.unfold)
            except ProtocolError as exc:
                _check_reply(exc)
        try:
            verify_task(received, PUB)
        except ProtocolError as exc:
            _check_reply(exc)


def _raw_frame(header_text: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(header_text)) + header_text + payload


# ---- parse_message -----------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=300))
def test_parse_arbitrary_bytes(data: bytes) -> None:
    _exercise(data)


@FUZZ
@given(st.binary(max_size=200), st.binary(max_size=200))
def test_parse_bytes_with_a_consistent_length_prefix(header: bytes, payload: bytes) -> None:
    _exercise(_raw_frame(header, payload))


@FUZZ
@given(headers(), st.binary(max_size=256))
def test_parse_random_json_headers(header: dict[str, Any], payload: bytes) -> None:
    data = encode_frame(header, [payload])
    _exercise(data)
    _exercise(data, SMALL_LIMITS)


@FUZZ
@given(
    st.recursive(
        json_scalars | st.floats() | st.sampled_from([float("nan"), float("inf")]),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
        max_leaves=20,
    ),
    st.sampled_from(sorted(MESSAGE_TYPES)),
)
def test_parse_headers_with_non_finite_numbers(value: Any, msg_type: str) -> None:
    # json.dumps (unlike the wire's canonical form) writes NaN/Infinity; a hostile
    # peer can send them, and json.loads would accept them without a hook
    for key in ("x", "seq", "compute_s", "gflops", "v", "tensors"):
        header = {"type": msg_type, "v": PROTOCOL_VERSION, "seq": 1, "state": "idle"}
        header.update({"in_flight": 0, key: value})
        _exercise(_raw_frame(json.dumps(header, allow_nan=True).encode()))
    # a well-formed signed task with one extra field: it must get as far as verify_task
    task = decode_frame(TASK_FRAMES[0])
    header = {**task.header, "x": value}
    text = json.dumps(header, allow_nan=True).encode()
    text += b" " * ((-(4 + len(text))) % 64)
    _exercise(_raw_frame(text, bytes(task.payload)))


@settings(FUZZ, max_examples=60)
@given(st.integers(1, 3000), st.sampled_from(["[", '{"a":', '[{"b":[']))
def test_parse_deeply_nested_headers(depth: int, opener: str) -> None:
    closer = {"[": "]", '{"a":': "}", '[{"b":[': "]}]"}[opener]
    nested = opener * depth + "0" + closer * depth
    for field in ("x", "tensors", "profile", "sig"):
        sig = "" if field == "sig" else f'"sig":"{"00" * 64}",'
        text = (
            f'{{"type":"task","v":{PROTOCOL_VERSION},"op":"mm","tile_id":"t","tensors":[],'
            f'{sig}"{field}":{nested}}}'
        )
        _exercise(_raw_frame(text.encode()))


def test_verify_task_survives_nesting_at_the_parser_limit() -> None:
    # find the deepest nesting json.loads accepts here; re-serialising it for the
    # signature check then recurses deeper than that and must not leak RecursionError
    deepest = None
    for depth in range(500, 4000):
        text = (
            f'{{"type":"task","v":{PROTOCOL_VERSION},"op":"mm","tile_id":"t","tensors":[],'
            f'"sig":"{"00" * 64}","x":{"[" * depth + "]" * depth}}}'
        )
        try:
            received = parse_message(_raw_frame(text.encode()))
        except ProtocolError:
            break
        deepest = received
    assert deepest is not None
    try:
        verify_task(deepest, PUB)
    except ProtocolError:
        pass


@st.composite
def byte_mutations(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(TASK_FRAMES)))
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.integers(0, 3))
        pos = draw(st.integers(0, len(data) - 1)) if data else 0
        if kind == 0 and data:
            data[pos] = draw(st.integers(0, 255))
        elif kind == 1:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif kind == 2 and data:
            del data[pos : pos + draw(st.integers(1, 16))]
        else:
            data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@FUZZ
@given(byte_mutations())
def test_parse_byte_mutated_task_frames(data: bytes) -> None:
    _exercise(data)


@st.composite
def header_mutations(draw: st.DrawFn) -> bytes:
    """Valid task frames with one header value replaced (deep inside, too) or removed."""
    frame = decode_frame(draw(st.sampled_from(TASK_FRAMES)))
    header = json.loads(json.dumps(frame.header))
    payload = bytes(frame.payload)
    for _ in range(draw(st.integers(1, 3))):
        target: Any = header
        while True:
            if isinstance(target, dict) and target:
                key = draw(st.sampled_from(sorted(target)))
            elif isinstance(target, list) and target:
                key = draw(st.integers(0, len(target) - 1))
            else:
                break
            if draw(st.booleans()) and isinstance(target[key], (dict, list)) and target[key]:
                target = target[key]
                continue
            action = draw(st.integers(0, 4))
            if action == 0 and isinstance(target, dict):
                del target[key]
            elif action == 1:
                target[key] = draw(dims)
            else:
                target[key] = draw(json_values)
            break
    if draw(st.booleans()):
        payload = payload[: draw(st.integers(0, len(payload)))]
    return encode_frame(header, [payload])


@FUZZ
@given(header_mutations())
def test_parse_header_mutated_task_frames(data: bytes) -> None:
    _exercise(data)
    _exercise(data, SMALL_LIMITS)


# ---- decode_tensors and check_operands ----------------------------------------------------------


@FUZZ
@given(
    st.lists(descriptors(weird=True), max_size=10) | json_values | py_weird, st.binary(max_size=512)
)
def test_decode_tensors_random_descriptors(descs: Any, payload: bytes) -> None:
    for limits in (None, SMALL_LIMITS):
        try:
            if limits is None:
                out = decode_tensors(descs, memoryview(payload))
            else:
                out = decode_tensors(descs, memoryview(payload), limits)
        except ProtocolError as exc:
            _check_reply(exc)
            continue
        for t in out.values():
            assert t.dtype in DTYPES.values()
            assert t.numel() * t.element_size() <= len(payload)


@st.composite
def operand_frames(draw: st.DrawFn) -> bytes:
    """Task frames with nearly consistent descriptors, so the tensors really get built."""
    descs = []
    offset = 0
    for name in draw(st.sampled_from([["a", "b"], ["a"], ["b", "a"], ["a", "b", "c"], ["a", "a"]])):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.lists(st.integers(0, 5), max_size=4))
        itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
        nbytes = math.prod(shape) * itemsize
        offset += draw(st.sampled_from([0, 0, 0, 1, 2, 3]))  # sometimes misaligned
        descs.append(
            {"name": name, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes}
        )
        offset += nbytes
    if draw(st.integers(0, 3)) == 0:
        victim = draw(st.sampled_from(descs))
        victim[draw(st.sampled_from(sorted(victim)))] = draw(
            dims | py_weird.filter(lambda v: isinstance(v, (bool, type(None))))
        )
    payload = draw(st.binary(min_size=offset, max_size=offset + 16))
    if draw(st.integers(0, 4)) == 0:
        payload = payload[: draw(st.integers(0, len(payload)))]
    op = draw(st.sampled_from(["mm", "bmm"]))
    header = {"type": "task", "v": PROTOCOL_VERSION, "tile_id": "t", "op": op, "tensors": descs}
    header["sig"] = "00" * 64
    return encode_frame(header, [payload])


@FUZZ
@given(operand_frames())
def test_received_tensors_then_check_operands(data: bytes) -> None:
    received = parse_message(data)  # the header itself is always well-formed here
    assert isinstance(received, Received) and isinstance(received.message, Task)
    try:
        tensors = received.tensors()
        a, b = check_operands(received.message.op, tensors)
    except ProtocolError:
        return
    # what check_operands lets through is a GEMM torch can run
    out = torch.bmm(a, b) if received.message.op == "bmm" else torch.mm(a, b)
    assert out.shape[-2:] == (a.shape[-2], b.shape[-1])


@FUZZ
@given(
    st.text(max_size=6) | st.sampled_from(["mm", "bmm"]),
    st.dictionaries(
        st.sampled_from(["a", "b", "c"]),
        st.tuples(
            st.lists(st.integers(0, 4), max_size=4),
            st.sampled_from([torch.float32, torch.float16, torch.float64, torch.int64]),
        ),
        max_size=3,
    ),
)
def test_check_operands_random_tensors(op: str, spec: dict[str, Any]) -> None:
    tensors = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
    try:
        check_operands(op, tensors)
    except ProtocolError:
        pass


@FUZZ
@given(headers(), st.text(max_size=130) | json_values | py_weird)
def test_verify_bundle_random_headers(header: dict[str, Any], sig: Any) -> None:
    header = {**header, "sig": sig}
    try:
        verify_bundle(PUB, header)
    except ProtocolError:
        return
    raise AssertionError("a random header verified")


# ---- the handshake's proofs -------------------------------------------------------------

AUTH_KEY_HEX = public_key_hex(KEY)
hexish = st.sampled_from(["", "00" * 32, "zz" * 32, AUTH_KEY_HEX, "ab" * 64, "a" * 63]) | st.text(
    max_size=80
)


@FUZZ
@given(headers(), hexish, hexish, st.text(max_size=20))
def test_checking_random_hellos_raises_protocol_errors_only(
    header: dict[str, Any], nonce: str, coordinator_key: str, token: str
) -> None:
    header["type"] = "hello"
    try:
        received = parse_message(encode_frame(header))
    except ProtocolError:
        return
    hello = received.message
    if not isinstance(hello, Hello):
        return
    with pytest.raises(ProtocolError):
        # Nothing random carries a valid signature for this challenge.
        check_hello(hello, received.frame.header, Challenge(nonce, coordinator_key), token)


@FUZZ
@given(headers(), hexish)
def test_checking_random_welcomes_raises_protocol_errors_only(
    header: dict[str, Any], nonce: str
) -> None:
    header["type"] = "welcome"
    try:
        received = parse_message(encode_frame(header))
    except ProtocolError:
        return
    welcome = received.message
    if not isinstance(welcome, Welcome):
        return
    hello = Hello("w", DeviceProfile(), 1, worker_key=AUTH_KEY_HEX, nonce=nonce)
    with pytest.raises(ProtocolError):
        check_welcome(welcome, received.frame.header, Challenge("00" * 32, AUTH_KEY_HEX), hello)
