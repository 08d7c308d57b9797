"""Worker -> coordinator result bytes per server CPU-second: websockets' own server
connection against the coordinator's (``coordinator.serve.zero_copy``).

A client subprocess on 127.0.0.1 sends messages of one result's size (an fp32 side x side
tile) as fast as the server takes them; this process serves them, first with websockets'
``ServerConnection``, then with ``ZeroCopyConnection``, and counts its own CPU time from
the first message to the last (the client's CPU is not counted). Runs alternate and the
best of each counts, since this shared machine's noise hits both.

Run: ``python bench/bench_ingress.py`` (``--quick`` for fewer bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from websockets.asyncio.client import connect  # noqa: E402
from websockets.asyncio.server import ServerConnection, serve  # noqa: E402

from coordinator.serve.zero_copy import ZeroCopyConnection  # noqa: E402

SIDES = (64, 256, 512, 1024)


def _sender(port: int, size: int, count: int) -> None:
    async def main() -> None:
        payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
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


def run(quick: bool, repeat: int) -> None:
    print(
        f"{'result (fp32)':>14} {'MB':>6} {'websockets MB/cpu-s':>20} "
        f"{'cleave MB/cpu-s':>16} {'ratio':>6}"
    )
    for side in SIDES:
        size = side * side * 4
        count = max(16, int((128 if quick else 512) * 2**20 // size))
        theirs = ours = float("inf")
        for _ in range(repeat):
            theirs = min(theirs, asyncio.run(_receive_all(ServerConnection, size, count)))
            ours = min(ours, asyncio.run(_receive_all(ZeroCopyConnection, size, count)))
        print(
            f"{f'{side}x{side}':>14} {size / 1e6:>6.2f} {1 / theirs:>20.0f} {1 / ours:>16.0f} "
            f"{theirs / ours:>6.2f}"
        )
    print(
        "(MB of result messages per CPU-second of the serving process; ratio: the "
        "coordinator's connection over websockets' own)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 MB per run instead of 512")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the best counts")
    args = parser.parse_args()
    run(args.quick, args.repeat)
