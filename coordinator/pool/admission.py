"""One connection's handshake, without I/O: the challenge it is sent, and the verdict on
the first frame it answers with (``common.auth``: a hello signed by the worker's key over
this challenge, proving the join token of a private pool).

The server's handshake (``coordinator.serve.handshake``) sends the challenge, reads one
frame, and sends what ``answer`` says; a worker is admitted to the core only after its
Welcome is out, so a client that vanishes mid-handshake never becomes a ghost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.auth import check_hello, make_welcome, new_nonce
from common.errors import ErrorCode, ProtocolError
from common.job_about import JobAbout
from common.limits import DEFAULT_LIMITS, WireLimits
from common.messages import Challenge, Error, Hello, encode_message, parse_message
from common.signing import public_key_hex
from coordinator.pool.core import CoordinatorCore
from coordinator.pool.effects import CloseCode
from coordinator.pool.front_door import Direction


@dataclass(frozen=True)
class Admitted:
    worker_id: str
    hello: Hello
    welcome: bytes  # the signed Welcome to send before ``CoordinatorCore.admit``


@dataclass(frozen=True)
class Refusal:
    code: CloseCode
    reason: str  # the close reason (also logged)
    reply: bytes | None = None  # an Error to send first, where the peer speaks the protocol


@dataclass(frozen=True)
class SentOn:
    """A worker welcomed and sent to another rank of the job (the welcome names it)."""

    reason: str  # the close reason (also logged)
    welcome: bytes  # the signed Welcome with ``serve_at``, to send before closing


@dataclass
class Admission:
    key: Ed25519PrivateKey
    core: CoordinatorCore
    job_name: str
    heartbeat_interval_s: float
    max_frame_bytes: int
    join_token: str = ""
    limits: WireLimits = DEFAULT_LIMITS
    about: JobAbout | None = None
    # With other coordinator ranks: this one's place, and where a joining worker goes.
    rank: int = 0
    ranks: int = 0
    front_door: Callable[[Hello], Direction | None] | None = None
    challenge: Challenge = field(init=False)

    def __post_init__(self) -> None:
        self.challenge = Challenge(
            nonce=new_nonce(),
            coordinator_key=public_key_hex(self.key),
            token_required=bool(self.join_token),
        )

    def challenge_frame(self) -> bytes:
        return encode_message(self.challenge)

    def answer(self, data: str | bytes) -> Admitted | Refusal | SentOn:
        """The verdict on the connection's first frame."""
        if isinstance(data, str):
            return Refusal(CloseCode.POLICY, "text frames are not part of the protocol")
        try:
            received = parse_message(data, self.limits)
            hello = received.message
            if not isinstance(hello, Hello):
                raise ProtocolError(
                    f"expected a hello, got a {received.frame.type!r} message",
                    code=ErrorCode.UNEXPECTED_MESSAGE,
                )
            check_hello(hello, received.frame.header, self.challenge, self.join_token)
        except ProtocolError as exc:
            reply = encode_message(Error(exc.code, exc.message))
            return Refusal(CloseCode.POLICY, f"bad hello: {exc.message}", reply)
        refusal = self.core.refusal(hello)
        if refusal:
            return Refusal(
                CloseCode.POLICY, refusal, encode_message(Error(ErrorCode.BANNED, refusal))
            )
        direction = None
        if self.front_door is not None and not hello.directed:
            direction = self.front_door(hello)
        worker_id = self.core.next_worker_id()
        welcome = make_welcome(
            self.key,
            hello,
            worker_id=worker_id,
            heartbeat_interval_s=self.heartbeat_interval_s,
            max_frame_bytes=self.max_frame_bytes,
            job=self.job_name,
            about=self.about,
            rank=self.rank,
            ranks=self.ranks,
            serve_at=direction.url if direction is not None else "",
        )
        if direction is not None:
            reason = f"sent to rank {direction.rank} at {direction.url}"
            return SentOn(reason, encode_message(welcome))
        return Admitted(worker_id, hello, encode_message(welcome))
