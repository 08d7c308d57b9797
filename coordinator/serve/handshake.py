"""A new connection's first seconds: challenge out, signed hello in, signed welcome out
(``common.auth``); and closing a connection that nobody reads yet."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from common.auth import check_hello, make_welcome, new_nonce
from common.errors import ErrorCode, ProtocolError
from common.messages import Challenge, Error, Hello, encode_message, parse_message
from common.signing import public_key_hex
from coordinator.pool.core import CoordinatorCore
from coordinator.pool.effects import CloseCode

if TYPE_CHECKING:
    from coordinator.serve.server import ServerConfig

WS_PATH = "/ws"


class Refused(Exception):
    """Close this connection during its handshake, with a reason."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


async def handshake(
    ws: ServerConnection,
    *,
    key: Ed25519PrivateKey,
    core: CoordinatorCore,
    config: ServerConfig,
    job_name: str,
) -> tuple[str, Hello]:
    """Challenge out, signed Hello in, signed Welcome out (``common.auth``).

    Registers nothing: the caller admits the worker once the Welcome is out.
    """
    if ws.request is not None and ws.request.path != WS_PATH:
        raise Refused(CloseCode.POLICY, f"workers connect to {WS_PATH}")
    challenge = Challenge(
        nonce=new_nonce(),
        coordinator_key=public_key_hex(key),
        token_required=bool(config.join_token),
    )
    await ws.send(encode_message(challenge))
    data = await ws.recv()
    if isinstance(data, str):
        raise Refused(CloseCode.POLICY, "text frames are not part of the protocol")
    try:
        received = parse_message(data, config.limits)
        hello = received.message
        if not isinstance(hello, Hello):
            raise ProtocolError(
                f"expected a hello, got a {received.frame.type!r} message",
                code=ErrorCode.UNEXPECTED_MESSAGE,
            )
        check_hello(hello, received.frame.header, challenge, config.join_token)
    except ProtocolError as exc:
        await ws.send(encode_message(Error(exc.code, exc.message)))
        raise Refused(CloseCode.POLICY, f"bad hello: {exc.message}") from None
    refusal = core.refusal(hello)
    if refusal:
        await ws.send(encode_message(Error(ErrorCode.BANNED, refusal)))
        raise Refused(CloseCode.POLICY, refusal)
    worker_id = core.next_worker_id()
    welcome = make_welcome(
        key,
        hello,
        worker_id=worker_id,
        heartbeat_interval_s=config.heartbeat_interval_s,
        max_frame_bytes=config.max_message_bytes,
        job=job_name,
    )
    await ws.send(encode_message(welcome))
    return worker_id, hello


def peer(ws: ServerConnection) -> str:
    try:
        host, port = ws.remote_address[:2]
    except (TypeError, ValueError):
        return "an unknown peer"
    return f"{host}:{port}"


async def close_unread(ws: ServerConnection, code: int, reason: str) -> None:
    """Close a connection nobody reads yet (a handshake), draining what the peer sends.

    The peer's closing frame may sit behind a full receive buffer (a flood); without the
    drain the close would wait out its whole timeout.
    """

    async def drain() -> None:
        with contextlib.suppress(ConnectionClosed):
            async for _ in ws:
                pass

    draining = asyncio.create_task(drain())
    try:
        await ws.close(code, close_reason(reason))
    finally:
        draining.cancel()
        await asyncio.gather(draining, return_exceptions=True)


def close_reason(text: str) -> str:
    """A WebSocket close reason must fit 123 bytes of UTF-8; ours may quote the peer."""
    return text.encode("utf-8")[:123].decode("utf-8", "ignore")
