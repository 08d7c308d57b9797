"""Received bytes per CPU-second of the receiving end, websockets' own connection against
Cleave's (``common.frame_reads``), on both ends:

- worker -> coordinator results: a client subprocess on 127.0.0.1 sends messages of one
  result's size (an fp32 side x side tile) as fast as the server takes them; this
  process serves them, first with websockets' ``ServerConnection``, then with the
  coordinator's ``ZeroCopyConnection``;
- coordinator -> worker tasks: a server subprocess (the coordinator's connection) sends
  tasks as the coordinator does: a header and two operand blocks, the blocks together an
  fp32 side x side tile's size, joined when small and otherwise written one after
  another as one frame (``common.frame_writes``); this process receives
  them, first with websockets' ``ClientConnection``, then with the worker's
  ``DirectReadConnection``.

This process counts its own CPU time from the first message to the last (the other
end's CPU is not counted). Runs alternate and the best of each counts, since this
shared machine's noise hits both.

Run: ``python bench/bench_ingress.py`` (``--quick`` for fewer bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from websockets.asyncio.client import ClientConnection, connect  # noqa: E402
from websockets.asyncio.server import ServerConnection, serve  # noqa: E402

from client_app.connection import DirectReadConnection  # noqa: E402
from common.frames import FrameParts  # noqa: E402
from coordinator.serve.zero_copy import ZeroCopyConnection  # noqa: E402

SIDES = (64, 256, 512, 1024)
TASK_HEAD_BYTES = 400  # a task's header, before its operands


def _message(size: int) -> bytes:
    return bytes(range(256)) * (size // 256) + bytes(size % 256)


def _sender(port: int, size: int, count: int) -> None:
    async def main() -> None:
        payload = _message(size)
        async with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
            for _ in range(count):
                await ws.send(payload)
            await ws.recv()

    asyncio.run(main())


async def _receive_all(connection: type[ServerConnection], size: int, count: int) -> float:
    """Server CPU-seconds per MB of messages after the first."""
    done: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    async def handler(ws: ServerConnection) -> None:
        await ws.recv()  # the first message starts the clock: a warm connection
        start = time.process_time()
        for _ in range(count - 1):
            if len(await ws.recv()) != size:
                raise AssertionError("a message arrived cut")
        spent = time.process_time() - start
        await ws.send("done")
        done.set_result(spent / ((count - 1) * size / 1e6))

    ctx = mp.get_context("spawn")
    async with serve(
        handler, "127.0.0.1", 0, compression=None, max_size=None, create_connection=connection
    ) as server:
        port = server.sockets[0].getsockname()[1]
        proc = ctx.Process(target=_sender, args=(port, size, count))
        proc.start()
        per_mb = await asyncio.wait_for(done, 300)
        await asyncio.to_thread(proc.join, 30)
    return per_mb


def _server(ports: Any, size: int, count: int) -> None:
    async def main() -> None:
        # As the coordinator sends a task: its header, then its two operand blocks.
        head, blocks = bytes(TASK_HEAD_BYTES), (_message(size // 2), _message(size - size // 2))
        task = FrameParts([head, *blocks])
        finished = asyncio.Event()

        async def handler(ws: ServerConnection) -> None:
            for _ in range(count):
                await ws.send(task)
            await ws.recv()
            finished.set()

        async with serve(
            handler,
            "127.0.0.1",
            0,
            compression=None,
            max_size=None,
            create_connection=ZeroCopyConnection,
        ) as server:
            ports.send(server.sockets[0].getsockname()[1])
            await asyncio.wait_for(finished.wait(), 300)

    asyncio.run(main())


async def _take_all(connection: type[ClientConnection], size: int, count: int) -> float:
    """Client CPU-seconds per MB of messages after the first."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_server, args=(theirs, size, count))
    proc.start()
    port = await asyncio.to_thread(ours.recv)
    async with connect(
        f"ws://127.0.0.1:{port}", compression=None, max_size=None, create_connection=connection
    ) as ws:
        await ws.recv()  # the first message starts the clock: a warm connection
        start = time.process_time()
        for _ in range(count - 1):
            if len(await ws.recv()) != size + TASK_HEAD_BYTES:
                raise AssertionError("a message arrived cut")
        spent = time.process_time() - start
        await ws.send("done")
    await asyncio.to_thread(proc.join, 30)
    return spent / ((count - 1) * size / 1e6)


def _table(
    what: str,
    end: str,
    repeat: int,
    quick: bool,
    measure: Callable[[bool, int, int], Coroutine[Any, Any, float]],
) -> None:
    print(f"{what:>16} {'MB':>6} {'websockets MB/cpu-s':>20} {'cleave MB/cpu-s':>16} {'ratio':>6}")
    for side in SIDES:
        size = side * side * 4
        count = max(16, int((128 if quick else 512) * 2**20 // size))
        theirs = ours = float("inf")
        for _ in range(repeat):
            theirs = min(theirs, asyncio.run(measure(False, size, count)))
            ours = min(ours, asyncio.run(measure(True, size, count)))
        print(
            f"{f'{side}x{side}':>16} {size / 1e6:>6.2f} {1 / theirs:>20.0f} {1 / ours:>16.0f} "
            f"{theirs / ours:>6.2f}"
        )
    print(f"(MB of messages per CPU-second of the {end}; ratio: Cleave's connection over")
    print("websockets' own)")


def run(quick: bool, repeat: int) -> None:
    _table(
        "result (fp32)",
        "coordinator receiving results",
        repeat,
        quick,
        lambda cleave, size, count: _receive_all(
            ZeroCopyConnection if cleave else ServerConnection, size, count
        ),
    )
    print()
    _table(
        "operands (fp32)",
        "worker receiving tasks",
        repeat,
        quick,
        lambda cleave, size, count: _take_all(
            DirectReadConnection if cleave else ClientConnection, size, count
        ),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 MB per run instead of 512")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the best counts")
    args = parser.parse_args()
    run(args.quick, args.repeat)
