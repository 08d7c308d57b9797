"""A new connection's first seconds: challenge out, signed hello in, signed welcome out
(``common.auth``); and closing a connection that nobody reads yet."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from common.job_about import JobAbout
from common.messages import Hello
from coordinator.pool.admission import Admission, Refusal, SentOn
from coordinator.pool.core import CoordinatorCore
from coordinator.pool.effects import CloseCode
from coordinator.pool.front_door import Direction

if TYPE_CHECKING:
    from coordinator.serve.server import ServerConfig

WS_PATH = "/ws"


class Refused(Exception):
    """Close this connection during its handshake, with a reason."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Directed(Exception):
    """The worker was welcomed and sent to another rank: close this connection."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def handshake(
    ws: ServerConnection,
    *,
    key: Ed25519PrivateKey,
    core: CoordinatorCore,
    config: ServerConfig,
    job_name: str,
    about: JobAbout | None = None,
    rank: int = 0,
    ranks: int = 0,
    front_door: Callable[[Hello], Direction | None] | None = None,
) -> tuple[str, Hello]:
    """Challenge out, one frame in, the verdict out (``coordinator.pool.admission``).

    Registers nothing: the caller admits the worker once the Welcome is out.
    """
    if ws.request is not None and ws.request.path != WS_PATH:
        raise Refused(CloseCode.POLICY, f"workers connect to {WS_PATH}")
    admission = Admission(
        key,
        core,
        job_name,
        about=about,
        heartbeat_interval_s=config.core.heartbeat_interval_s,
        max_frame_bytes=config.max_message_bytes,
        join_token=config.join_token,
        limits=config.core.limits,
        rank=rank,
        ranks=ranks,
        front_door=front_door,
    )
    await ws.send(admission.challenge_frame())
    verdict = admission.answer(await ws.recv())
    if isinstance(verdict, Refusal):
        if verdict.reply is not None:
            await ws.send(verdict.reply)
        raise Refused(verdict.code, verdict.reason)
    if isinstance(verdict, SentOn):
        await ws.send(verdict.welcome)
        raise Directed(verdict.reason)
    await ws.send(verdict.welcome)
    return verdict.worker_id, verdict.hello


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
