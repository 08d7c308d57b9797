"""The Error messages a worker sends back, and what it can tell of a frame it could not
parse (to name the tile and message type in its reply)."""

from __future__ import annotations

from common.errors import ErrorCode, ProtocolError
from common.frames import Buffer, decode_frame
from common.limits import WireLimits
from common.messages import Error


def error_message(exc: ProtocolError, tile_id: str, limits: WireLimits) -> Error:
    """``exc`` as an Error message, cut to the protocol's string limits."""
    return Error(
        code=exc.code[: limits.max_string_chars],
        message=exc.message[: limits.max_message_chars],
        tile_id=tile_id,
    )


def named_in(data: Buffer | str, limits: WireLimits) -> tuple[str, str]:
    """The message type and tile id a bad frame's header names, best effort ("" when
    unreadable: a text message, a header that does not decode, an overlong tile id)."""
    if isinstance(data, str):
        return "", ""
    try:
        header = decode_frame(data, limits).header
    except ProtocolError:
        header = {}
    tile_id = header.get("tile_id")
    if not isinstance(tile_id, str) or len(tile_id) > limits.max_string_chars:
        tile_id = ""
    return str(header.get("type", "")), tile_id


def sent_by_workers(msg_type: str) -> ProtocolError:
    """The error for a coordinator that sent a worker-to-coordinator message."""
    return ProtocolError(
        f"{msg_type!r} is sent by workers, not coordinators", code=ErrorCode.UNEXPECTED_MESSAGE
    )
