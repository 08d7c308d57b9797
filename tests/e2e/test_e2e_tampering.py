"""A tampering network between coordinator and one worker: that worker must refuse the
bundle with a clear error, the coordinator must re-issue the tile, and training must
still match local torch."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.procs import Coordinator, Worker, assert_losses_match
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from common.frames import decode_frame, encode_frame
from common.signing import generate_private_key, sign_bundle
from coordinator import train_locally
from coordinator.jobs.tiny_gpt import make_job as make_tiny_gpt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def tamper(frame: bytes, mode: str) -> bytes:
    parsed = decode_frame(frame)
    header, payload = dict(parsed.header), bytearray(parsed.payload)
    if mode == "flip_payload_byte":
        payload[len(payload) // 2] ^= 0x01
    else:  # "foreign_key": a valid signature, by a key the worker never pinned
        header["sig"] = sign_bundle(generate_private_key(), header)
    return encode_frame(header, [bytes(payload)])


class TamperingProxy:
    """Forwards one worker's connection, tampering with the first ``count`` task frames."""

    def __init__(self, upstream: str, mode: str, count: int = 2) -> None:
        self.upstream = upstream
        self.mode = mode
        self.remaining = count
        self.tampered = 0
        self.port = 0
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> TamperingProxy:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with serve(self._relay, "127.0.0.1", 0, compression=None, max_size=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._stop.wait()

    async def _relay(self, worker: ServerConnection) -> None:
        async with connect(self.upstream, compression=None, max_size=None) as coord:

            async def down() -> None:
                async for frame in coord:
                    assert isinstance(frame, bytes)
                    if self.remaining and decode_frame(frame).type == "task":
                        self.remaining -= 1
                        self.tampered += 1
                        frame = tamper(frame, self.mode)
                    await worker.send(frame)

            async def up() -> None:
                async for frame in worker:
                    await coord.send(frame)

            tasks = [asyncio.create_task(down()), asyncio.create_task(up())]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            except ConnectionClosed:
                pass
            finally:
                for task in tasks:
                    task.cancel()


@pytest.fixture(params=["flip_payload_byte", "foreign_key"])
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def test_tampered_bundle_is_refused_and_reissued(tmp_path: Path, mode: str) -> None:
    steps = 3
    coord = Coordinator(tmp_path, "--steps", str(steps), "--min-workers", "2")
    with TamperingProxy(coord.url, mode) as proxy:
        victim = Worker(tmp_path, f"ws://127.0.0.1:{proxy.port}/ws", "behind-proxy")
        honest = Worker(tmp_path, coord.url, "direct")
        try:
            assert coord.wait(180) == 0, coord.output()
        finally:
            victim.stop()
            honest.stop()
        assert proxy.tampered == 2
    assert victim.output().count("bad_signature") >= 2, victim.output()
    assert "refused tile" in coord.output()
    records = coord.steps()
    assert sum(r["reissued"] for r in records) >= 2, records
    assert_losses_match([r["loss"] for r in records], train_locally(make_tiny_gpt(), steps))
