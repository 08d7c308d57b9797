"""The exceptions both sides share: the only ones that decoders in `common` raise on bad
input, and ``ConfigError`` for a configuration that cannot be used.

Every decoding error carries a short machine-readable ``code`` that goes into the wire ``error``
message, and a human-readable message that says what was wrong and which limit applied.
"""

from __future__ import annotations

from enum import Enum

# Messages often echo the offending value, which a hostile peer controls (a 60 KB dtype
# string, a 4000-digit integer). Cut them well below WireLimits.max_message_chars, so an
# ``error`` reply built from any ProtocolError is itself a valid message.
MAX_ERROR_CHARS = 1024


class ErrorCode(str, Enum):
    """Every ``code`` an ``error`` message carries, from either side. Values are the wire
    strings; a peer's unknown code still parses (it is shown, not trusted)."""

    # decoding (common)
    BAD_MESSAGE = "bad_message"
    BAD_FRAME = "bad_frame"
    LIMIT_EXCEEDED = "limit_exceeded"
    BAD_TENSOR = "bad_tensor"
    BAD_SIGNATURE = "bad_signature"
    AUTH_FAILED = "auth_failed"
    BAD_TOKEN = "bad_token"
    BAD_OP = "bad_op"
    VERSION = "version"
    UNKNOWN_TYPE = "unknown_type"
    UNEXPECTED_MESSAGE = "unexpected_message"
    MISSING_BLOCK = "missing_block"
    # the coordinator's answers
    NOT_ASSIGNED = "not_assigned"
    FAILED_CHECK = "failed_check"
    BANNED = "banned"
    RATE_LIMITED = "rate_limited"
    # the worker's answers
    PAUSED = "paused"
    DUPLICATE_TILE = "duplicate_tile"
    COMPUTE_FAILED = "compute_failed"

    def __str__(self) -> str:
        return self.value


class ProtocolError(Exception):
    """A message broke the wire protocol. The connection that sent it is at fault."""

    code: str = ErrorCode.BAD_MESSAGE

    def __init__(self, message: str, *, code: str | None = None) -> None:
        if len(message) > MAX_ERROR_CHARS:
            # keep both ends: the limit's name usually comes last
            head, tail = MAX_ERROR_CHARS * 2 // 3, MAX_ERROR_CHARS // 3
            cut = len(message) - head - tail
            message = f"{message[:head]}[...{cut} characters cut...]{message[-tail:]}"
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0])


class FrameError(ProtocolError):
    """The outer frame (length prefix, header JSON, payload bounds) is malformed."""

    code: str = ErrorCode.BAD_FRAME


class LimitExceeded(ProtocolError):
    """A named limit (frame size, header size, tensor shape, ...) was exceeded."""

    code: str = ErrorCode.LIMIT_EXCEEDED


class TensorCodecError(ProtocolError):
    """A tensor descriptor does not match the payload or uses a forbidden dtype/shape."""

    code: str = ErrorCode.BAD_TENSOR


class SignatureError(ProtocolError):
    """A task bundle's signature is missing, malformed, or not made by the pinned key."""

    code: str = ErrorCode.BAD_SIGNATURE


class KeyMismatchError(Exception):
    """The coordinator presented a different key from the one pinned at first join."""

    def __init__(self, url: str, pinned: str, presented: str) -> None:
        super().__init__(
            f"coordinator key changed for {url}: pinned {pinned}, presented {presented}. "
            "Refusing to compute. If the operator really rotated the key, remove the pin "
            f"with `cleave-worker --forget {url}`."
        )
        self.url = url
        self.pinned = pinned
        self.presented = presented


class AuthError(ProtocolError):
    """A handshake proof (signature, nonce, join token) is missing or does not verify."""

    code: str = ErrorCode.AUTH_FAILED


class ConfigError(Exception):
    """A configuration (the coordinator's TOML file, the worker's settings, pins or
    identity) exists but cannot be used; the message names the file, the key and what is
    wrong."""
