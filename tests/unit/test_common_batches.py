"""Batches: several protocol messages in one WebSocket message, each as it was alone."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.batches import BATCH_BELOW_BYTES, Batch, batch_frame, inner_frames, packed
from common.errors import ErrorCode, FrameError, LimitExceeded, ProtocolError, SignatureError
from common.frames import PAYLOAD_ALIGN, FrameParts, decode_frame, encode_frame
from common.limits import DEFAULT_LIMITS, WireLimits
from common.messages import (
    Heartbeat,
    Result,
    Task,
    encode_message,
    parse_message,
    parse_messages,
    verify_task,
)
from common.signing import SIGNATURE_FIELD, generate_private_key
from common.task_messages import LazyTask, task_frame
from common.tensors import encode_block

RESULT = encode_message(Result("g/t0", compute_s=0.25), [("c", torch.arange(15.0).reshape(3, 5))])
BEAT = encode_message(Heartbeat(7, "working", 1))


def _inner(data: bytes, limits: WireLimits = DEFAULT_LIMITS) -> list[bytes]:
    return [bytes(f) for f in inner_frames(parse_message(data, limits))]


def test_a_batch_holds_each_frame_as_it_was_alone_at_aligned_offsets() -> None:
    data = batch_frame([BEAT, RESULT, BEAT])
    assert _inner(data) == [BEAT, RESULT, BEAT]
    # Each inner frame starts on an aligned offset of the whole message, so its tensors
    # lie as aligned as in a frame of their own, and decode the same.
    received = parse_message(data)
    assert isinstance(received.message, Batch)
    frames = inner_frames(received)
    at = len(data) - len(received.frame.payload)
    for size, frame in zip(received.message.frames, frames, strict=True):
        at += -at % PAYLOAD_ALIGN
        assert at % PAYLOAD_ALIGN == 0 and bytes(frame) == data[at : at + size]
        at += size
    result = parse_message(frames[1])
    assert torch.equal(result.tensors()["c"], torch.arange(15.0).reshape(3, 5))


def _with_payload(sizes: list[int], payload: bytes) -> bytes:
    return encode_frame(
        {"type": "batch", "v": decode_frame(BEAT).header["v"], "frames": sizes}, [payload]
    )


def test_a_batch_that_does_not_add_up_is_a_frame_error() -> None:
    pad = bytes(-len(BEAT) % PAYLOAD_ALIGN)
    good = BEAT + pad + BEAT
    assert _inner(_with_payload([len(BEAT), len(BEAT)], good)) == [BEAT, BEAT]
    with pytest.raises(FrameError, match="runs past"):
        _inner(_with_payload([len(BEAT), len(BEAT) + 1], good))
    with pytest.raises(FrameError, match="after its last frame"):
        _inner(_with_payload([len(BEAT), len(BEAT)], good + b"\0"))
    if pad:  # bytes hidden in the padding are refused, not ignored
        smuggled = BEAT + b"x" + pad[1:] + BEAT
        with pytest.raises(FrameError, match="non-zero bytes between"):
            _inner(_with_payload([len(BEAT), len(BEAT)], smuggled))


@pytest.mark.parametrize("sizes", [[], [0], [-3], [True], ["12"], 5, None])
def test_a_batch_without_frame_lengths_is_a_bad_message(sizes: object) -> None:
    header = {"type": "batch", "v": decode_frame(BEAT).header["v"], "frames": sizes}
    with pytest.raises(ProtocolError) as info:
        parse_message(encode_frame(header, [BEAT]))
    assert info.value.code == ErrorCode.BAD_MESSAGE


def test_a_batch_over_the_frame_limit_is_refused_by_name() -> None:
    limits = WireLimits(max_batch_frames=2)
    with pytest.raises(LimitExceeded, match="max_batch_frames=2"):
        parse_message(batch_frame([BEAT] * 3), limits)
    assert _inner(batch_frame([BEAT] * 2), limits) == [BEAT, BEAT]


def test_packed_batches_runs_of_small_frames_in_order_and_sends_large_ones_alone() -> None:
    big = FrameParts([bytes(BATCH_BELOW_BYTES)])
    out = list(packed([BEAT, RESULT, big, BEAT, BEAT, BEAT, RESULT], most=3))
    assert len(out) == 4
    assert _inner(out[0]) == [BEAT, RESULT]
    assert out[1] is big
    assert _inner(out[2]) == [BEAT, BEAT, BEAT]
    assert out[3] is RESULT  # a run of one goes as it is
    assert list(packed([BEAT], most=8)) == [BEAT]
    assert list(packed([], most=8)) == []
    small_parts = FrameParts([BEAT[:10], BEAT[10:]])
    assert _inner(next(packed([small_parts, BEAT], most=8))) == [BEAT, BEAT]


# ---- small tasks under one signature ----------------------------------------------------

KEY = generate_private_key()
A, B = torch.randn(6, 4), torch.randn(4, 5)


def lazy(tile_id: str, key: Ed25519PrivateKey = KEY) -> LazyTask:
    task = task_frame(tile_id, "mm", encode_block(A), encode_block(B), key, lazy=True)
    assert isinstance(task, LazyTask)
    return task


OTHER = generate_private_key()


def _flip_digest(data: bytes) -> bytes:
    at = data.index(b'"tasks":["') + len(b'"tasks":["')
    return data[:at] + (b"1" if data[at : at + 1] == b"0" else b"0") + data[at + 1 :]


def signed_batch() -> bytes:
    return batch_frame([lazy("t-1"), BEAT, lazy("t-2")])


def test_small_tasks_travel_under_the_batchs_one_signature() -> None:
    data = signed_batch()
    header = decode_frame(data).header
    assert SIGNATURE_FIELD in header and header["tasks"][1] == ""
    tasks = [r for r in parse_messages(data) if isinstance(r.message, Task)]
    assert [r.message.tile_id for r in tasks] == ["t-1", "t-2"]
    for received in tasks:
        assert SIGNATURE_FIELD not in received.frame.header  # no signature of its own
        a, b = verify_task(received, KEY.public_key())
        assert torch.equal(a, A) and torch.equal(b, B)


@pytest.mark.parametrize(
    ("tamper", "match"),
    [
        (lambda d: d.replace(b'"tile_id":"t-1"', b'"tile_id":"t-9"'), "digest its batch"),
        (lambda d: _flip_digest(d), "signature does not verify"),
        (lambda d: d[:-8] + bytes(b ^ 1 for b in d[-8:]), "content id"),
        (lambda d: batch_frame([lazy("t-1", OTHER), BEAT, lazy("t-2", OTHER)]), "pinned"),
    ],
    ids=["task header", "digest list", "operand byte", "foreign key"],
)
def test_a_batch_tampered_anywhere_vouches_for_nothing(tamper: Any, match: str) -> None:
    data = tamper(signed_batch())
    refused = 0
    for received in parse_messages(data):
        if isinstance(received.message, Task):
            try:
                verify_task(received, KEY.public_key())
            except SignatureError as exc:
                assert re.search(match, str(exc)), exc
                refused += 1
    assert refused >= 1


def test_tasks_of_two_keys_never_share_a_batch() -> None:
    with pytest.raises(ValueError, match="one key"):
        batch_frame([lazy("t-1"), lazy("t-2", OTHER)])


def test_an_unsigned_task_outside_a_signed_batch_is_refused() -> None:
    alone = lazy("t-1").vouched()
    for data in (alone, batch_frame([alone, BEAT])):
        [received, *_] = parse_messages(data)
        with pytest.raises(SignatureError, match="no well-formed signature"):
            verify_task(received, KEY.public_key())


def test_a_small_task_sent_alone_is_signed_and_the_same_length_as_reckoned() -> None:
    task = lazy("t-1")
    reckoned = len(task)
    [out] = list(packed([task], most=8))
    assert isinstance(out, FrameParts) and len(out) == reckoned
    verify_task(parse_message(out.join()), KEY.public_key())


@pytest.mark.parametrize(
    "fields",
    [
        {"tasks": ["a" * 64]},
        {"tasks": ["a" * 64, ""]},
        {"sig": "ab" * 64},
        {"tasks": ["", ""], "sig": "ab" * 64},
        {"tasks": ["short", ""], "sig": "ab" * 64},
    ],
)
def test_digests_and_a_signature_go_together(fields: dict[str, Any]) -> None:
    header = {"type": "batch", "v": decode_frame(BEAT).header["v"], "frames": [1, 1], **fields}
    with pytest.raises(ProtocolError):
        parse_message(encode_frame(header, [b"\0" * 65]))
