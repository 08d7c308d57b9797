"""A fake coordinator on 127.0.0.1 that speaks the protocol to a real worker core, and what
the worker tests drive it with."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable
from typing import TypeVar

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from client_app.compute import TileComputer
from client_app.worker import RunResult, WorkerCore
from common.auth import check_hello, make_welcome, new_nonce
from common.messages import (
    Ack,
    Challenge,
    DeviceProfile,
    Heartbeat,
    Hello,
    Received,
    Result,
    encode_message,
    encode_task,
    parse_message,
    parse_messages,
)
from common.signing import generate_private_key, public_key_hex

PROFILE = DeviceProfile("cpu", "test cpu", 1, 1 << 33, 1 << 28, 10.0)


T = TypeVar("T")


async def within(aw: Awaitable[T], seconds: float = 10.0) -> T:
    return await asyncio.wait_for(aw, seconds)


class Link:
    """One worker connection, as the fake coordinator sees it."""

    def __init__(self, ws: ServerConnection, hello: Hello) -> None:
        self.ws = ws
        self.hello = hello
        self.inbox: asyncio.Queue[Received] = asyncio.Queue()
        self.heartbeats: list[Heartbeat] = []
        self.sizes: list[int] = []  # bytes of each WebSocket message received, in order
        self.closed = asyncio.Event()
        assert ws.request is not None
        # What the worker offered: it must not ask for permessage-deflate (DESIGN §3).
        self.extensions_offered = ws.request.headers.get("Sec-WebSocket-Extensions")

    async def send(self, frame: bytes) -> None:
        await self.ws.send(frame)

    async def expect(self, cls: type, timeout: float = 10.0) -> Received:
        """The next message that is not a heartbeat; it must be a ``cls``."""
        received = await within(self.inbox.get(), timeout)
        assert isinstance(received.message, cls), received.message
        return received


class FakeCoordinator:
    def __init__(
        self,
        key: Ed25519PrivateKey | None = None,
        *,
        heartbeat_interval_s: float = 0.05,
        max_size: int = 1 << 26,
        announced_max_frame_bytes: int | None = None,
        reject_first: int = 0,
    ) -> None:
        self.key = key or generate_private_key()
        self.reject_first = reject_first  # close this many connections before welcoming
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_size = max_size
        self.announced_max_frame_bytes = announced_max_frame_bytes or max_size
        self.links: asyncio.Queue[Link] = asyncio.Queue()
        self.connections = 0
        self.results = 0
        self._server: Server | None = None
        self.url = ""

    async def __aenter__(self) -> FakeCoordinator:
        self._server = await serve(
            self._handle, "127.0.0.1", 0, compression=None, max_size=self.max_size
        )
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}/ws"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await within(self._server.wait_closed())

    async def next_link(self, timeout: float = 10.0) -> Link:
        return await within(self.links.get(), timeout)

    def task(self, tile_id: str, a: torch.Tensor, b: torch.Tensor, op: str = "mm") -> bytes:
        return encode_task(tile_id, op, a, b, self.key)

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        if self.connections <= self.reject_first:
            await ws.close()
            return
        challenge = Challenge(new_nonce(), public_key_hex(self.key))
        await ws.send(encode_message(challenge))
        received = parse_message(await within(ws.recv()))
        hello = received.message
        assert isinstance(hello, Hello), hello
        check_hello(hello, received.frame.header, challenge)  # a worker proves its key
        welcome = make_welcome(
            self.key,
            hello,
            worker_id=f"w{self.connections}",
            heartbeat_interval_s=self.heartbeat_interval_s,
            max_frame_bytes=self.announced_max_frame_bytes,
            job="loopback",
        )
        await ws.send(encode_message(welcome))
        link = Link(ws, hello)
        self.links.put_nowait(link)
        try:
            async for data in ws:
                assert isinstance(data, bytes), "the worker must send binary frames only"
                link.sizes.append(len(data))
                for received in parse_messages(data):
                    await self._take(ws, link, received)
        except ConnectionClosed:
            pass
        finally:
            link.closed.set()

    async def _take(self, ws: ServerConnection, link: Link, received: Received) -> None:
        if isinstance(received.message, Heartbeat):
            link.heartbeats.append(received.message)
            ack = Ack(received.message.seq, credit_tiles=self.results, credit_gflop=0.5)
            # A worker that leaves may close right after its last heartbeat: the Ack then
            # fails, and what it sent before closing (its Bye) must still be read, as the
            # real coordinator's separate writer does.
            with contextlib.suppress(ConnectionClosed):
                await ws.send(encode_message(ack))
            return
        if isinstance(received.message, Result):
            self.results += 1
        link.inbox.put_nowait(received)


def operands(seed: int, shape: tuple[int, ...] = (16, 24, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    *batch, m, k, n = shape
    return torch.randn(*batch, m, k, generator=gen), torch.randn(*batch, k, n, generator=gen)


async def stop(core: WorkerCore, run: asyncio.Task[RunResult]) -> RunResult:
    core.stop()
    return await within(run)


class HeldComputer(TileComputer):
    """Holds its first tile until released: "still computing" for as long as a test
    needs, however loaded the machine (a big GEMM once finished first under load)."""

    def __init__(self) -> None:
        super().__init__(1, use_gpu=False)
        self.started = threading.Event()
        self.release = threading.Event()
        self.computed = 0  # tiles multiplied

    def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.computed += 1
        if not self.started.is_set():
            self.started.set()
            self.release.wait(30)
        return super().compute(op, a, b)
