"""Protocol messages: typed views of frame headers, validated on the way in.

Each message is a frozen dataclass with ``to_header()`` and ``from_header()``; tensors
(task operands, result tiles) travel in the frame payload and are described by the
header's ``"tensors"`` list (see ``common.tensors``). ``parse_message`` is the single
entry point for received bytes and raises only ``ProtocolError`` subclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common import PROTOCOL_VERSION
from common.batches import Batch, Voucher, inner_frames, vouchers
from common.control_messages import (
    WORKER_STATES,
    Ack,
    Bye,
    Cancel,
    Error,
    Heartbeat,
    JobState,
    Pause,
    Resume,
    sign_job_state,
    verify_job_state,
)
from common.errors import (
    ErrorCode,
    FrameError,
    ProtocolError,
)
from common.frames import Frame, FrameParts, decode_frame, encode_frame, frame_head
from common.handshake_messages import MAX_URL_CHARS, Challenge, DeviceProfile, Hello, Welcome
from common.limits import DEFAULT_LIMITS, WireLimits
from common.message_fields import wire_header
from common.task_messages import (
    BLOCK_FIELD,
    REF_FIELD,
    Result,
    Task,
    check_operands,
    encode_task,
    task_frame,
    verify_task,
    verify_task_blocks,
)
from common.tensors import (
    decode_tensors,
    encode_tensors,
)

__all__ = [
    "BLOCK_FIELD",
    "Batch",
    "MAX_URL_CHARS",
    "MESSAGE_TYPES",
    "REF_FIELD",
    "WORKER_STATES",
    "Ack",
    "Bye",
    "Cancel",
    "Challenge",
    "DeviceProfile",
    "Error",
    "Heartbeat",
    "Hello",
    "JobState",
    "Message",
    "Pause",
    "Received",
    "Result",
    "Resume",
    "Task",
    "Welcome",
    "check_operands",
    "encode_message",
    "encode_task",
    "parse_message",
    "parse_messages",
    "sign_job_state",
    "task_frame",
    "verify_job_state",
    "verify_task",
    "verify_task_blocks",
    "wire_header",
]


Message = (
    Challenge
    | Hello
    | Welcome
    | Task
    | Result
    | Heartbeat
    | Ack
    | JobState
    | Cancel
    | Error
    | Pause
    | Resume
    | Bye
    | Batch
)
MESSAGE_TYPES: dict[str, Any] = {
    cls.TYPE: cls
    for cls in (
        Challenge,
        Hello,
        Welcome,
        Task,
        Result,
        Heartbeat,
        Ack,
        JobState,
        Cancel,
        Error,
        Pause,
        Resume,
        Bye,
        Batch,
    )
}


def encode_message(msg: Message, tensors: list[tuple[str, torch.Tensor]] | None = None) -> bytes:
    """Frame a message; tensors (if any) go into the payload and the header's "tensors"."""
    return encode_frame(*_header_and_payload(msg, tensors))


def message_parts(
    msg: Message, tensors: list[tuple[str, torch.Tensor]] | None = None
) -> FrameParts:
    """``encode_message``'s frame as its parts: the tensors' bytes are not copied into
    it (they must not change until it is sent)."""
    header, payload = _header_and_payload(msg, tensors)
    return FrameParts([frame_head(header), *payload])


def _header_and_payload(
    msg: Message, tensors: list[tuple[str, torch.Tensor]] | None
) -> tuple[dict[str, Any], list[memoryview | bytes]]:
    header = wire_header(msg)
    parts: list[memoryview | bytes] = []
    if tensors:
        header["tensors"], parts = encode_tensors(tensors)
    return header, parts


@dataclass(frozen=True)
class Received:
    message: Message
    frame: Frame
    # A task that came unsigned in a signed batch: what vouches for it (``verify_task``).
    voucher: Voucher | None = None

    def tensors(self, limits: WireLimits = DEFAULT_LIMITS) -> dict[str, torch.Tensor]:
        return decode_tensors(self.frame.header.get("tensors", []), self.frame.payload, limits)


def parse_message(
    data: bytes | bytearray | memoryview,
    limits: WireLimits = DEFAULT_LIMITS,
    voucher: Voucher | None = None,
) -> Received:
    """Decode and validate one received message (``voucher``: what vouches for it, if it
    came in a signed batch). Raises ProtocolError subclasses only."""
    if isinstance(data, str):
        raise ProtocolError("text messages are not part of the protocol; send binary frames")
    frame = decode_frame(data, limits)
    if frame.header["v"] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {frame.header['v']} is not supported (this side speaks "
            f"{PROTOCOL_VERSION})",
            code=ErrorCode.VERSION,
        )
    cls = MESSAGE_TYPES.get(frame.type)
    if cls is None:
        raise ProtocolError(
            f"unknown message type {frame.type[:64]!r}", code=ErrorCode.UNKNOWN_TYPE
        )
    return Received(message=cls.from_header(frame.header, limits), frame=frame, voucher=voucher)


def parse_messages(
    data: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS
) -> list[Received]:
    """``parse_message`` for a peer that sends batches (``common.batches``): the message,
    or each message of a batch, in order."""
    received = parse_message(data, limits)
    if not isinstance(received.message, Batch):
        return [received]
    inner = [
        parse_message(frame, limits, voucher)
        for frame, voucher in zip(inner_frames(received), vouchers(received), strict=True)
    ]
    if any(isinstance(r.message, Batch) for r in inner):
        raise FrameError("a batch inside a batch")
    return inner
