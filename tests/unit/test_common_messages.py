"""Protocol messages: round trips, signed tasks, operand checks, and validation errors."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch

from common import PROTOCOL_VERSION
from common.errors import LimitExceeded, ProtocolError, SignatureError, TensorCodecError
from common.frames import decode_frame, encode_frame
from common.job_about import JobAbout
from common.limits import WireLimits
from common.messages import (
    MESSAGE_TYPES,
    Ack,
    Batch,
    Bye,
    Cancel,
    Challenge,
    DeviceProfile,
    Error,
    Heartbeat,
    Hello,
    JobState,
    Message,
    Pause,
    Received,
    Result,
    Resume,
    Task,
    Welcome,
    check_operands,
    encode_message,
    encode_task,
    parse_message,
    verify_task,
    verify_task_blocks,
)
from common.ops import TILE_OPS
from common.signing import SIGNATURE_FIELD, generate_private_key, public_key_hex, sign_bundle
from common.tensors import content_id

KEY = generate_private_key()
PUB = KEY.public_key()

PROFILE = DeviceProfile(
    device="cuda",
    device_name="RTX 4090",
    threads=16,
    ram_bytes=64 << 30,
    mem_cap_bytes=2 << 30,
    gflops=812.5,
)
DESCRIPTORS = [
    {"name": "a", "dtype": "float32", "shape": [2, 3], "offset": 0, "nbytes": 24},
    {"name": "b", "dtype": "float32", "shape": [3, 4], "offset": 64, "nbytes": 48},
]

MESSAGES: list[Message] = [
    Hello(name="alice-laptop", profile=PROFILE, window=4, client="cleave-app"),
    Hello(name="w", profile=DeviceProfile(), window=1),
    Welcome(
        worker_id="w-17",
        coordinator_key=public_key_hex(KEY),
        heartbeat_interval_s=2.5,
        max_frame_bytes=64 << 20,
        job="gpt-tiny",
        sig="34" * 64,
    ),
    Welcome(
        worker_id="w-1", coordinator_key="ab", heartbeat_interval_s=1, max_frame_bytes=1, job=""
    ),
    Task(tile_id="g1/t0", op="mm", tensors=DESCRIPTORS),
    Task(tile_id="g1/t1", op="bmm", tensors=[], sig="ab" * 64),
    Result(tile_id="g1/t0", compute_s=0.125, tensors=DESCRIPTORS[:1]),
    Result(tile_id="g1/t0", compute_s=0.0),
    Heartbeat(seq=0, state="working", in_flight=3),
    Heartbeat(seq=1 << 40, state="paused", in_flight=0, reason="on battery"),
    Heartbeat(seq=5, state="idle", in_flight=0, reason=""),
    Ack(seq=7, credit_tiles=1234, credit_gflop=56.75),
    Cancel(tile_id="g1/t9"),
    Error(code="unknown_type", message="unknown message type 'x'"),
    Error(code="bad_tensor", message="m" * 4096, tile_id="g2/t3"),
    Pause(reason="owner is typing"),
    Resume(),
    Bye(),
    Bye(reason="shutting down"),
    Challenge(nonce="ab" * 32, coordinator_key=public_key_hex(KEY), token_required=True),
    Challenge(nonce="", coordinator_key=""),
    Hello(
        name="bob",
        profile=PROFILE,
        window=2,
        worker_key=public_key_hex(KEY),
        nonce="cd" * 32,
        token_proof="ef" * 32,
        sig="12" * 64,
    ),
    Welcome(
        worker_id="w-2",
        coordinator_key="ab",
        heartbeat_interval_s=1,
        max_frame_bytes=1,
        job="sonnets",
        about=JobAbout("sonnets", "a\nb", "Lab 7", "https://x.example", 124_000_000),
    ),
    JobState(step=1204, steps=5000, note="the coordinator computes faster alone", sig="cd" * 64),
    JobState(step=0, steps=0),
    Batch(frames=(64, 3, 1 << 20)),
]


def _frame(msg_type: str, **fields: Any) -> bytes:
    return encode_frame({"type": msg_type, "v": PROTOCOL_VERSION, **fields})


def _fields(msg: Message) -> dict[str, Any]:
    return msg.to_header()


def _expect(
    data: bytes | str, code: str, match: str | None = None, limits: WireLimits | None = None
) -> ProtocolError:
    with pytest.raises(ProtocolError, match=match) as info:
        if limits is None:
            parse_message(data)  # type: ignore[arg-type]
        else:
            parse_message(data, limits)  # type: ignore[arg-type]
    assert info.value.code == code, info.value
    return info.value


# ---- round trips -----------------------------------------------------------------------


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in MESSAGES} == set(MESSAGE_TYPES.values())
    assert set(MESSAGE_TYPES) == {
        "challenge",
        "hello",
        "welcome",
        "task",
        "result",
        "heartbeat",
        "ack",
        "job_state",
        "cancel",
        "error",
        "pause",
        "resume",
        "bye",
        "batch",
    }


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    received = parse_message(encode_message(msg))
    assert isinstance(received, Received)
    assert type(received.message) is type(msg)
    assert received.message == msg
    assert received.frame.header["type"] == msg.TYPE
    assert received.frame.header["v"] == PROTOCOL_VERSION
    # and from the mutable/view buffer types a transport may hand over
    data = encode_message(msg)
    assert parse_message(bytearray(data)).message == msg
    assert parse_message(memoryview(data)).message == msg


def test_round_trip_with_tensors_in_payload() -> None:
    c = torch.randn(5, 7)
    msg = Result(tile_id="g1/t0", compute_s=0.5)
    received = parse_message(encode_message(msg, [("c", c)]))
    assert isinstance(received.message, Result)
    assert received.message.tile_id == "g1/t0"
    assert received.message.tensors == received.frame.header["tensors"]
    assert received.message.tensors[0]["shape"] == [5, 7]
    out = received.tensors()
    assert list(out) == ["c"]
    assert torch.equal(out["c"], c)
    assert dataclasses.replace(msg, tensors=received.message.tensors) == received.message


def test_messages_without_tensors_decode_to_no_tensors() -> None:
    data = encode_message(Heartbeat(seq=1, state="idle", in_flight=0))
    assert parse_message(data).tensors() == {}


def test_integer_float_fields_accept_integers() -> None:
    fields = _fields(Ack(seq=1, credit_tiles=2, credit_gflop=3.0))
    fields["credit_gflop"] = 3
    msg = parse_message(_frame("ack", **fields)).message
    assert msg == Ack(seq=1, credit_tiles=2, credit_gflop=3.0)
    assert isinstance(msg, Ack) and isinstance(msg.credit_gflop, float)


def test_unknown_extra_fields_are_ignored() -> None:
    fields = {**_fields(Cancel(tile_id="t")), "future_field": {"x": [1, 2]}}
    assert parse_message(_frame("cancel", **fields)).message == Cancel(tile_id="t")


# ---- signed tasks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str
)
@pytest.mark.parametrize(
    "op,a_shape,b_shape",
    [
        ("mm", (3, 5), (5, 2)),
        ("mm", (1, 1), (1, 1)),
        ("mm", (4, 0), (0, 3)),
        ("bmm", (2, 3, 4), (2, 4, 5)),
        ("bmm", (1, 0, 4), (1, 4, 2)),
    ],
)
def test_encode_task_verify_task_round_trip(
    dtype: torch.dtype, op: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...]
) -> None:
    a = torch.randn(a_shape, dtype=torch.float64).to(dtype)
    b = torch.randn(b_shape, dtype=torch.float64).to(dtype)
    data = encode_task("g4/t2", op, a, b, KEY)
    received = parse_message(data)
    assert isinstance(received.message, Task)
    assert received.message.tile_id == "g4/t2"
    assert received.message.op == op
    assert len(received.message.sig) == 128
    got_a, got_b = verify_task(received, PUB)
    assert got_a.dtype == dtype and got_b.dtype == dtype
    assert torch.equal(got_a, a) and torch.equal(got_b, b)


def test_verify_task_with_non_contiguous_operands() -> None:
    a = torch.randn(5, 3).t()
    b = torch.randn(5, 6)[:, ::2]
    got_a, got_b = verify_task(parse_message(encode_task("t", "mm", a, b, KEY)), PUB)
    assert torch.equal(got_a, a) and torch.equal(got_b, b)


def test_verify_task_refuses_another_key() -> None:
    data = encode_task("t", "mm", torch.ones(2, 2), torch.ones(2, 2), KEY)
    with pytest.raises(SignatureError):
        verify_task(parse_message(data), generate_private_key().public_key())


def test_verify_task_refuses_a_tampered_payload_byte() -> None:
    data = bytearray(encode_task("t", "mm", torch.ones(2, 2), torch.ones(2, 2), KEY))
    data[-1] ^= 0x40
    received = parse_message(bytes(data))  # still parses: the frame itself is fine
    with pytest.raises(SignatureError):
        verify_task(received, PUB)


def test_verify_task_refuses_an_unsigned_task() -> None:
    a, b = torch.ones(2, 2), torch.ones(2, 2)
    data = encode_message(Task(tile_id="t", op="mm", tensors=[]), [("a", a), ("b", b)])
    with pytest.raises(SignatureError, match="no well-formed signature"):
        verify_task(parse_message(data), PUB)


def test_verify_task_refuses_non_task_messages() -> None:
    received = parse_message(encode_message(Cancel(tile_id="t")))
    with pytest.raises(ProtocolError, match="expected a task"):
        verify_task(received, PUB)


def test_verify_task_checks_operands_after_the_signature() -> None:
    # a correctly signed task whose operands do not make a GEMM is still refused
    data = encode_task("t", "mm", torch.ones(2, 3), torch.ones(2, 3), KEY)
    with pytest.raises(TensorCodecError, match="shapes do not match"):
        verify_task(parse_message(data), PUB)


def test_encode_task_refuses_unknown_op() -> None:
    with pytest.raises(ValueError, match="not one of"):
        encode_task("t", "conv2d", torch.ones(2, 2), torch.ones(2, 2), KEY)


# ---- operand checks -----------------------------------------------------------------------


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def test_check_operands_accepts_valid_gemms() -> None:
    a, b = _t(2, 3), _t(3, 4)
    assert check_operands("mm", {"a": a, "b": b}) == (a, b)
    a3, b3 = _t(5, 2, 3), _t(5, 3, 4)
    got = check_operands("bmm", {"a": a3, "b": b3})
    assert got[0] is a3 and got[1] is b3


@pytest.mark.parametrize(
    "op,a,b,match",
    [
        ("mm", _t(2, 3), _t(4, 5), "shapes do not match"),
        ("mm", _t(2, 3), _t(2, 3), "shapes do not match"),
        ("mm", _t(2, 3, 4), _t(2, 4, 5), "needs 2-D"),
        ("mm", _t(3), _t(3, 1), "needs 2-D"),
        ("mm", _t(2, 3), _t(3), "needs 2-D"),
        ("mm", _t(), _t(), "needs 2-D"),
        ("mm", _t(2, 3), _t(3, 4, dtype=torch.float64), "dtypes differ"),
        ("mm", _t(2, 3, dtype=torch.bfloat16), _t(3, 4, dtype=torch.float16), "dtypes differ"),
        ("bmm", _t(2, 3), _t(3, 4), "needs 3-D"),
        ("bmm", _t(1, 2, 3, 4), _t(1, 2, 4, 5), "needs 3-D"),
        ("bmm", _t(2, 2, 3), _t(3, 3, 4), "shapes do not match"),
        ("bmm", _t(2, 2, 3), _t(2, 4, 4), "shapes do not match"),
        ("bmm", _t(2, 2, 3), _t(2, 3, 4, dtype=torch.float16), "dtypes differ"),
    ],
)
def test_check_operands_refuses(op: str, a: torch.Tensor, b: torch.Tensor, match: str) -> None:
    with pytest.raises(TensorCodecError, match=match):
        check_operands(op, {"a": a, "b": b})


@pytest.mark.parametrize("names", [set(), {"a"}, {"b"}, {"a", "b", "c"}, {"x", "y"}, {"A", "B"}])
def test_check_operands_needs_exactly_a_and_b(names: set[str]) -> None:
    with pytest.raises(TensorCodecError, match="exactly tensors 'a' and 'b'"):
        check_operands("mm", {n: _t(2, 2) for n in names})


@pytest.mark.parametrize("op", ["", "MM", "matmul", "addmm"])
def test_check_operands_refuses_ops_off_the_whitelist(op: str) -> None:
    with pytest.raises(ProtocolError, match="not one of") as info:
        check_operands(op, {"a": _t(2, 2, 2), "b": _t(2, 2, 2)})
    assert info.value.code == "bad_op"
    assert set(TILE_OPS) == {"mm", "bmm"}


def test_check_operands_bounds_the_output_size() -> None:
    big = 1 << 24
    # no operand data at all (K=0), but a 2^48-element product
    with pytest.raises(LimitExceeded, match="max_tensor_elements"):
        check_operands("mm", {"a": _t(big, 0), "b": _t(0, big)})
    with pytest.raises(LimitExceeded, match="output of 24 elements"):
        check_operands(
            "bmm", {"a": _t(2, 3, 1), "b": _t(2, 1, 4)}, WireLimits(max_tensor_elements=23)
        )
    check_operands("bmm", {"a": _t(2, 3, 1), "b": _t(2, 1, 4)}, WireLimits(max_tensor_elements=24))


def test_signed_task_with_a_huge_output_is_refused() -> None:
    big = 1 << 24
    data = encode_task("t", "mm", _t(big, 0), _t(0, big), KEY)
    with pytest.raises(LimitExceeded):
        verify_task(parse_message(data), PUB)


# ---- validation errors -------------------------------------------------------------------


def test_text_input_is_refused() -> None:
    _expect("hello", "bad_message", "text messages")
    _expect('{"type":"hello","v":1}', "bad_message", "binary frames")


@pytest.mark.parametrize(
    "msg_type", ["nope", "HELLO", "Hello", "task ", "x" * 1000, "__init__", "TYPE", "to_header"]
)
def test_unknown_type(msg_type: str) -> None:
    err = _expect(_frame(msg_type), "unknown_type", "unknown message type")
    assert len(err.message) < 200  # the echoed type is truncated


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, -1, 10**100])
def test_wrong_version(version: int) -> None:
    data = encode_frame({"type": "hello", "v": version, **_fields(MESSAGES[0])})
    err = _expect(data, "version", "not supported")
    assert str(PROTOCOL_VERSION) in err.message
    # the version is checked before the type
    _expect(encode_frame({"type": "nope", "v": version}), "version")


def test_frame_errors_surface_with_their_codes() -> None:
    _expect(b"", "bad_frame", "shorter")
    _expect(encode_frame({"type": "hello", "v": True}), "bad_frame", "protocol version")
    _expect(b"\x00\x00\x00\x02[]", "bad_frame", "JSON object")
    _expect(
        encode_frame({"type": "hello", "v": 1}, [b"\0" * 2000]),
        "limit_exceeded",
        "max_frame_bytes",
        WireLimits(max_frame_bytes=1024, max_header_bytes=512),
    )


# A table of every field of every message: (type, field, kind, lo, hi). It drives the
# missing-field, wrong-type and out-of-range tests below.
STR, INT, NUM = "str", "int", "num"
FIELD_SPECS: list[tuple[Message, str, str, float, float]] = [
    (MESSAGES[0], "name", STR, 0, 0),
    (MESSAGES[0], "client", STR, 0, 0),
    (MESSAGES[0], "window", INT, 1, 64),
    (MESSAGES[2], "worker_id", STR, 0, 0),
    (MESSAGES[2], "coordinator_key", STR, 0, 0),
    (MESSAGES[2], "heartbeat_interval_s", NUM, 0.01, 3600),
    (MESSAGES[2], "max_frame_bytes", INT, 1, 1 << 62),
    (MESSAGES[2], "job", STR, 0, 0),
    (MESSAGES[4], "tile_id", STR, 0, 0),
    (MESSAGES[4], "op", STR, 0, 0),
    (MESSAGES[6], "tile_id", STR, 0, 0),
    (MESSAGES[6], "compute_s", NUM, 0, 1e6),
    (MESSAGES[9], "seq", INT, 0, 1 << 62),
    (MESSAGES[9], "state", STR, 0, 0),
    (MESSAGES[9], "in_flight", INT, 0, 1 << 20),
    (MESSAGES[11], "seq", INT, 0, 1 << 62),
    (MESSAGES[11], "credit_tiles", INT, 0, 1 << 62),
    (MESSAGES[11], "credit_gflop", NUM, 0, 1e18),
    (MESSAGES[12], "tile_id", STR, 0, 0),
    (MESSAGES[13], "code", STR, 0, 0),
    (MESSAGES[13], "message", STR, 0, 0),
    (MESSAGES[15], "reason", STR, 0, 0),
]
OPTIONAL_STR = [(MESSAGES[9], "reason"), (MESSAGES[14], "tile_id"), (MESSAGES[18], "reason")]
PROFILE_SPECS: list[tuple[str, str, float, float]] = [
    ("device", STR, 0, 0),
    ("device_name", STR, 0, 0),
    ("threads", INT, 1, 4096),
    ("ram_bytes", INT, 0, 1 << 62),
    ("mem_cap_bytes", INT, 0, 1 << 62),
    ("gflops", NUM, 0, 1e18),
]

WRONG_TYPES: dict[str, list[Any]] = {
    STR: [None, 1, 1.5, True, [], {}, ["x"]],
    INT: [None, "1", 1.0, 2.5, True, False, [], {}, [1]],
    NUM: [None, "1.0", True, False, [], {}, [1.0]],
}


def _spec_id(spec: Any) -> str:
    return f"{spec[0].TYPE}.{spec[1]}"


@pytest.mark.parametrize("spec", FIELD_SPECS, ids=_spec_id)
def test_missing_field(spec: tuple[Message, str, str, float, float]) -> None:
    msg, name = spec[0], spec[1]
    fields = _fields(msg)
    del fields[name]
    _expect(_frame(msg.TYPE, **fields), "bad_message", f'"{name}"')


@pytest.mark.parametrize("spec", FIELD_SPECS, ids=_spec_id)
def test_wrong_field_type(spec: tuple[Message, str, str, float, float]) -> None:
    msg, name, kind = spec[0], spec[1], spec[2]
    for bad in WRONG_TYPES[kind]:
        fields = {**_fields(msg), name: bad}
        err = _expect(_frame(msg.TYPE, **fields), "bad_message", f'"{name}"')
        assert msg.TYPE in err.message


@pytest.mark.parametrize("spec", [s for s in FIELD_SPECS if s[2] != STR], ids=_spec_id)
def test_out_of_range(spec: tuple[Message, str, str, float, float]) -> None:
    msg, name, kind, lo, hi = spec
    below = lo - 1 if kind == INT else lo - 0.005 if lo else -1e-9
    above = hi + 1 if kind == INT else hi * 1.0001
    for bad in (below, above, -(10**30), 10**30):
        fields = {**_fields(msg), name: bad}
        _expect(_frame(msg.TYPE, **fields), "bad_message", re.escape(f'"{name}"={bad}'))
    for ok in (lo, hi):
        fields = {**_fields(msg), name: int(ok) if kind == INT else ok}
        parse_message(_frame(msg.TYPE, **fields))


@pytest.mark.parametrize("spec", [s for s in FIELD_SPECS if s[2] == STR], ids=_spec_id)
def test_string_too_long(spec: tuple[Message, str, str, float, float]) -> None:
    msg, name = spec[0], spec[1]
    limit = 4096 if (msg.TYPE, name) == ("error", "message") else 256
    fields = {**_fields(msg), name: "x" * (limit + 1)}
    _expect(_frame(msg.TYPE, **fields), "bad_message", "too long")


@pytest.mark.parametrize("spec", OPTIONAL_STR, ids=_spec_id)
def test_optional_string_fields(spec: tuple[Message, str]) -> None:
    msg, name = spec
    fields = _fields(msg)
    fields.pop(name, None)
    parse_message(_frame(msg.TYPE, **fields))
    bad: Any
    for bad in (None, 1, [], True):
        _expect(_frame(msg.TYPE, **{**fields, name: bad}), "bad_message", f'"{name}"')
    _expect(_frame(msg.TYPE, **{**fields, name: "x" * 257}), "bad_message", "too long")


def test_negative_zero_is_accepted_as_zero() -> None:
    fields = {**_fields(MESSAGES[7]), "compute_s": -0.0}
    msg = parse_message(_frame("result", **fields)).message
    assert isinstance(msg, Result) and msg.compute_s == 0.0


@pytest.mark.parametrize("state", ["", "busy", "Working", "paused "])
def test_heartbeat_state_whitelist(state: str) -> None:
    fields = {**_fields(MESSAGES[8]), "state": state}
    _expect(_frame("heartbeat", **fields), "bad_message", "not one of")


@pytest.mark.parametrize("op", ["", "addmm", "MM", "conv"])
def test_task_op_whitelist(op: str) -> None:
    fields = {**_fields(MESSAGES[4]), "op": op}
    _expect(_frame("task", **fields), "bad_op", "not one of")


@pytest.mark.parametrize("tensors", [None, {}, "a", 1, True])
def test_task_and_result_need_a_tensor_list(tensors: Any) -> None:
    for msg in (MESSAGES[4], MESSAGES[6]):
        fields = {**_fields(msg), "tensors": tensors}
        _expect(_frame(msg.TYPE, **fields), "bad_message", '"tensors" must be a list')
        fields.pop("tensors")
        _expect(_frame(msg.TYPE, **fields), "bad_message", '"tensors" must be a list')


@pytest.mark.parametrize("sig", [None, 1, [], {}, True])
def test_task_sig_must_be_a_string(sig: Any) -> None:
    fields = {**_fields(MESSAGES[4]), "sig": sig}
    _expect(_frame("task", **fields), "bad_message", '"sig" must be a string')


# ---- hello.profile ------------------------------------------------------------------------


def _hello_fields(**profile_overrides: Any) -> dict[str, Any]:
    fields = _fields(MESSAGES[0])
    fields["profile"] = {**fields["profile"], **profile_overrides}
    return fields


@pytest.mark.parametrize("profile", [None, [], "cpu", 1, True])
def test_profile_must_be_an_object(profile: Any) -> None:
    fields = {**_fields(MESSAGES[0]), "profile": profile}
    _expect(_frame("hello", **fields), "bad_message", '"profile" must be an object')


def test_missing_profile_names_the_first_missing_field() -> None:
    fields = _fields(MESSAGES[0])
    del fields["profile"]
    _expect(_frame("hello", **fields), "bad_message", 'hello.profile: field "device"')


@pytest.mark.parametrize("spec", PROFILE_SPECS, ids=lambda s: s[0])
def test_profile_fields(spec: tuple[str, str, float, float]) -> None:
    name, kind, lo, hi = spec
    fields = _hello_fields()
    del fields["profile"][name]
    _expect(_frame("hello", **fields), "bad_message", f'hello.profile: field "{name}"')
    for bad in WRONG_TYPES[kind]:
        _expect(_frame("hello", **_hello_fields(**{name: bad})), "bad_message", f'"{name}"')
    if kind != STR:
        for bad in (lo - 1, hi * 2, -(10**30)):
            _expect(_frame("hello", **_hello_fields(**{name: bad})), "bad_message", f'"{name}"')


@pytest.mark.parametrize("device", ["", "CPU", "gpu", "mps", "cuda:0"])
def test_profile_device_whitelist(device: str) -> None:
    _expect(_frame("hello", **_hello_fields(device=device)), "bad_message", "cpu")


def test_error_codes_are_short_strings() -> None:
    for exc_cls in (ProtocolError, TensorCodecError, LimitExceeded, SignatureError):
        assert isinstance(exc_cls.code, str) and 0 < len(exc_cls.code) < 32
    assert ProtocolError("x", code="custom").code == "custom"
    assert ProtocolError("x").code == "bad_message"


def test_long_error_messages_are_cut_so_an_error_reply_stays_valid() -> None:
    # the offending value is echoed, and a hostile peer controls its size
    fields = {**_fields(MESSAGES[8]), "seq": 10**4000}
    err = _expect(_frame("heartbeat", **fields), "bad_message", "outside")
    bad_desc = [{"name": "a", "dtype": "d" * 60_000, "shape": [], "offset": 0, "nbytes": 4}]
    received = parse_message(_frame("result", tile_id="t", compute_s=0, tensors=bad_desc))
    with pytest.raises(TensorCodecError, match="is not one of") as info:
        received.tensors()
    dtype_err = info.value
    for exc in (err, dtype_err):
        assert len(exc.message) <= 2048
        assert "characters cut" in exc.message
        reply = Error(code=exc.code, message=exc.message)
        assert parse_message(encode_message(reply)).message == reply


def test_short_error_messages_are_kept_whole() -> None:
    text = "x" * 1024
    assert ProtocolError(text).message == text


# ---- operand blocks (the worker's cache) ---------------------------------------------------


def test_operands_by_reference_resolve_from_the_cache_and_are_checked() -> None:
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    a_id, b_id = content_id(a), content_id(b)
    whole = parse_message(encode_task("t", "mm", a, b, KEY))
    (got_a, got_b), arrived = verify_task_blocks(whole, PUB)
    assert set(arrived) == {a_id, b_id} and torch.equal(arrived[a_id], a)
    by_ref = parse_message(encode_task("t", "mm", a, b, KEY, ids=(a_id, b_id), refs=frozenset("a")))
    assert len(by_ref.frame.payload) < len(whole.frame.payload)
    (ra, rb), arrived = verify_task_blocks(by_ref, PUB, blocks={a_id: a})
    assert torch.equal(ra, a) and torch.equal(rb, b) and set(arrived) == {b_id}
    with pytest.raises(ProtocolError) as missing:
        verify_task(by_ref, PUB, blocks={})
    assert missing.value.code == "missing_block"
    with pytest.raises(TensorCodecError, match="does not match"):
        verify_task(by_ref, PUB, blocks={a_id: torch.randn(4, 4)})
    with pytest.raises(ValueError, match="refs need content ids"):
        encode_task("t", "mm", a, b, KEY, refs=frozenset("a"))


def test_an_operand_under_a_wrong_content_id_is_refused() -> None:
    """A coordinator that signs a wrong id (or a tamperer that swaps operands between
    tasks signed alike) cannot slip other bytes under it."""
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    wrong = parse_message(encode_task("t", "mm", a, b, KEY, ids=(content_id(b), None)))
    with pytest.raises(SignatureError, match="content id"):
        verify_task(wrong, PUB)


@pytest.mark.parametrize("where", ["padding", "trailing"])
def test_bytes_outside_the_operands_are_refused(where: str) -> None:
    a, b = torch.randn(3, 3), torch.randn(3, 2)  # a is 36 bytes: padding follows it
    frame = decode_frame(encode_task("t", "mm", a, b, KEY))
    payload = bytearray(frame.payload)
    if where == "padding":
        payload[40] = 1
    else:
        payload += b"\0"
    tampered = parse_message(encode_frame(dict(frame.header), [bytes(payload)]))
    with pytest.raises(SignatureError, match="unsigned bytes"):
        verify_task(tampered, PUB)


# ---- transposed blocks -----------------------------------------------------------------------


@pytest.mark.parametrize("op", ["mm", "bmm"])
def test_a_transposed_view_travels_as_its_transpose_and_arrives_as_the_operand(op: str) -> None:
    """A linear layer's weight as the B operand is a transposed view: it is laid out in
    the order its bytes lie, marked, and the worker computes with the very operand."""
    batch = (2,) if op == "bmm" else ()
    a = torch.randn(*batch, 4, 3)
    weight = torch.randn(*batch, 5, 3)
    b = weight.mT  # [.., 3, 5], its last two dims swapped in memory
    frame = encode_task("t", op, a, b, KEY)
    received = parse_message(frame)
    descs = {d["name"]: d for d in received.frame.header["tensors"]}
    assert descs["b"]["transposed"] is True and descs["b"]["shape"] == [*batch, 5, 3]
    assert "transposed" not in descs["a"]
    (got_a, got_b), arrived = verify_task_blocks(received, PUB)
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
    # The cache keeps the bytes as they lie, under the id the worker recomputes.
    assert torch.equal(arrived[content_id(weight)], weight)
    assert torch.equal(got_a @ got_b, a @ b)


def test_a_transposed_block_by_reference_is_swapped_from_the_cached_bytes() -> None:
    """The same cached bytes serve a task that takes them as they lie and one that
    takes their transpose: each task's signed descriptor says which."""
    a, weight = torch.randn(4, 3), torch.randn(5, 3)
    w_id = content_id(weight)
    plain = parse_message(encode_task("t1", "mm", torch.randn(2, 5), weight, KEY))
    _, arrived = verify_task_blocks(plain, PUB)
    assert set(arrived) >= {w_id}
    by_ref = parse_message(
        encode_task("t2", "mm", a, weight.mT, KEY, ids=(None, w_id), refs=frozenset("b"))
    )
    (_, got_b), _ = verify_task_blocks(by_ref, PUB, blocks=arrived)
    assert torch.equal(got_b, weight.mT)


def _with_mark(frame: bytes, operand: int, value: Any, *, sign: bool) -> Received:
    """``frame`` with operand ``operand``'s "transposed" field set to ``value``, signed
    again by the coordinator's key or left with the old signature (a tamperer's)."""
    decoded = decode_frame(frame)
    header = {k: v for k, v in decoded.header.items() if k != SIGNATURE_FIELD}
    header["tensors"] = [dict(d) for d in header["tensors"]]
    header["tensors"][operand]["transposed"] = value
    header[SIGNATURE_FIELD] = sign_bundle(KEY, header) if sign else decoded.header[SIGNATURE_FIELD]
    return parse_message(encode_frame(header, [bytes(decoded.payload)]))


def test_the_transposed_mark_is_signed_and_checked() -> None:
    a, b = torch.randn(4, 3), torch.randn(5, 3).mT
    frame = encode_task("t", "mm", a, b, KEY)
    # In transit: dropping or changing the mark breaks the signature.
    for operand, value in ((1, False), (1, "yes"), (0, True)):
        with pytest.raises(SignatureError):
            verify_task(_with_mark(frame, operand, value, sign=False), PUB)
    # Signed, a mark that is not a boolean is refused by name.
    for value in ("yes", 1, None):
        with pytest.raises(TensorCodecError, match="must be true or false"):
            verify_task(_with_mark(frame, 1, value, sign=True), PUB)
    # Signed, a dropped mark leaves bytes that do not make the GEMM: refused, not run.
    with pytest.raises(TensorCodecError, match="shapes do not match"):
        verify_task(_with_mark(frame, 1, False, sign=True), PUB)
    # Signed, a mark on an operand that has no two dims to swap.
    one_d = encode_task("t", "mm", torch.randn(3), torch.randn(3, 2), KEY)
    with pytest.raises(TensorCodecError, match="1-D operand cannot be transposed"):
        verify_task(_with_mark(one_d, 0, True, sign=True), PUB)
