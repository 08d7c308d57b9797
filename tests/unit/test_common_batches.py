"""Batches: several protocol messages in one WebSocket message, each as it was alone."""

from __future__ import annotations

import pytest
import torch

from common.batches import BATCH_BELOW_BYTES, Batch, batch_frame, inner_frames, packed
from common.errors import ErrorCode, FrameError, LimitExceeded, ProtocolError
from common.frames import PAYLOAD_ALIGN, FrameParts, decode_frame, encode_frame
from common.limits import DEFAULT_LIMITS, WireLimits
from common.messages import Heartbeat, Result, encode_message, parse_message

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
