"""The worker's WebSocket to its coordinator: opening it, sending on it, closing it.

Thin wrappers over websockets that hold what the pump must not forget: no compression
(DESIGN §3), large frames read and written without websockets' copies
(``common.frame_reads``, ``common.frame_writes``), a stop that does not wait out the
open timeout, and the teardown race after a close with code 1009 (DESIGN §6).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.protocol import State

from common.frame_reads import FrameReads
from common.frame_writes import FrameWrites
from common.frames import FrameParts

log = logging.getLogger("client_app.worker")  # the pump's log, as it has always been

PING_INTERVAL_S = 20.0
OPEN_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0


class DirectReadConnection(FrameReads, FrameWrites, ClientConnection):
    """websockets' client connection, reading a large frame (a task's operands) straight
    into a buffer of its size and writing one (a result) masked part by part, rather
    than through websockets' copies."""


async def open_connection(
    url: str, *, tls: ssl.SSLContext | None, max_size: int, stop: asyncio.Event
) -> ClientConnection | None:
    """The open connection, or None if ``stop`` was set first (OSError, websockets'
    errors and TimeoutError when it cannot be opened)."""
    # websockets refuses ssl= on a ws:// URL, so pass it only for wss://.
    extra: dict[str, Any] = {"ssl": tls} if tls is not None else {}
    opening = asyncio.ensure_future(
        connect(
            url,
            **extra,
            # Deflate on float tensors cuts throughput ~25x and saves almost nothing.
            compression=None,
            max_size=max_size,
            ping_interval=PING_INTERVAL_S,
            open_timeout=OPEN_TIMEOUT_S,
            close_timeout=CLOSE_TIMEOUT_S,
            create_connection=DirectReadConnection,
        )
    )
    # A stop must not wait out the open timeout of an unresponsive host.
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({opening, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not opening.done():
        opening.cancel()
        await asyncio.gather(opening, return_exceptions=True)
        return None
    return opening.result()


# DESIGN §6: once the peer closed with 1009 (we sent a frame over its limit) while a
# large frame was still being written, websockets aborts a transport that asyncio has
# already torn down, and send()/close() raise AttributeError ('NoneType' object has no
# attribute 'call_soon'). Only on a connection that is no longer open is that this
# known teardown race; on an open one it would be a real bug and is re-raised.


async def send_frames(ws: ClientConnection, *frames: bytes | FrameParts) -> None:
    for frame in frames:
        try:
            await ws.send(frame)
        except AttributeError:
            if ws.state is State.OPEN:
                raise
            raise ConnectionAbortedError("connection torn down after the peer closed it") from None


async def close_quietly(ws: ClientConnection) -> None:
    try:
        await ws.close()
    except AttributeError:
        if ws.state is State.OPEN:
            raise
        log.debug("connection to the coordinator was already torn down")


def describe(exc: BaseException) -> str:
    """An exception in a few words for a log line."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
