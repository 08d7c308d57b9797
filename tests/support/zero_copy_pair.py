"""A client connected to a server whose connections are the coordinator's
``ZeroCopyConnection`` (or other connection classes), on 127.0.0.1, plain or TLS."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve

from coordinator.serve.zero_copy import ZeroCopyConnection


@contextlib.asynccontextmanager
async def zero_copy_pair(
    handler: Callable[[ServerConnection], Awaitable[None]],
    server_tls: ssl.SSLContext | None,
    client_tls: ssl.SSLContext | None,
    server: type[ServerConnection] = ZeroCopyConnection,
    client: type[ClientConnection] = ClientConnection,
) -> AsyncIterator[ClientConnection]:
    """The client's connection (a stock websockets one unless ``client`` says);
    ``handler`` serves it. Neither side compresses or limits message sizes."""
    async with serve(
        handler,
        "127.0.0.1",
        0,
        ssl=server_tls,
        compression=None,
        max_size=None,
        create_connection=server,
    ) as listening:
        port = listening.sockets[0].getsockname()[1]
        scheme = "wss" if client_tls else "ws"
        async with connect(
            f"{scheme}://127.0.0.1:{port}",
            ssl=client_tls,
            compression=None,
            max_size=None,
            create_connection=client,
        ) as ws:
            yield ws
