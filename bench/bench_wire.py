"""Coordinator -> worker tile bytes/s on loopback vs a bare websockets sink.

Both runs send the same frame sizes over one WebSocket connection on 127.0.0.1, from
this process to a receiver subprocess:

- bare:   pre-built bytes of the same size; the receiver drops them.
- cleave: real signed task bundles (``task_frame``), sent as the coordinator sends
          them (on its ``ZeroCopyConnection``: a large one as one frame
          written part by part) to a worker's ``DirectReadConnection``; the receiver
          does what a worker does before computing: ``parse_message`` +
          ``verify_task`` (BLAKE3 + Ed25519 + operand decode).

Also reports bytes on the wire vs tensor bytes (framing overhead).
Run: ``python bench/bench_wire.py`` (``--quick`` for fewer repetitions).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from websockets.asyncio.client import ClientConnection, connect  # noqa: E402
from websockets.asyncio.server import ServerConnection, serve  # noqa: E402

from client_app.connection import DirectReadConnection  # noqa: E402
from common.messages import parse_message, task_frame, verify_task  # noqa: E402
from common.signing import generate_private_key, public_key_from_hex, public_key_hex  # noqa: E402
from common.tensors import encode_block  # noqa: E402
from coordinator.serve.zero_copy import ZeroCopyConnection  # noqa: E402

SIDES = (128, 256, 512, 1024)


def _receiver(port: int, mode: str, count: int, key_hex: str, out: mp.Queue) -> None:
    async def main() -> None:
        key = public_key_from_hex(key_hex)
        async with connect(
            f"ws://127.0.0.1:{port}/ws",
            compression=None,
            max_size=None,
            create_connection=DirectReadConnection if mode == "cleave" else ClientConnection,
        ) as ws:
            got = 0
            nbytes = 0
            start = 0.0
            while got < count:
                frame = await ws.recv()
                if got == 0:
                    start = time.perf_counter()  # first frame starts the clock (warm link)
                else:
                    nbytes += len(frame)
                if mode == "cleave":
                    assert isinstance(frame, bytes)
                    verify_task(parse_message(frame), key)
                got += 1
            out.put((nbytes, time.perf_counter() - start))

    asyncio.run(main())


async def _send_all(frames: list[Any], mode: str, key_hex: str) -> tuple[int, float]:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    done = asyncio.Event()

    async def handler(ws: ServerConnection) -> None:
        for frame in frames:
            await ws.send(frame)
        await ws.wait_closed()
        done.set()

    async with serve(
        handler,
        "127.0.0.1",
        0,
        compression=None,
        max_size=None,
        create_connection=ZeroCopyConnection if mode == "cleave" else ServerConnection,
    ) as server:
        port = server.sockets[0].getsockname()[1]
        proc = ctx.Process(target=_receiver, args=(port, mode, len(frames), key_hex, out))
        proc.start()
        result = await asyncio.to_thread(out.get, True, 300)
        proc.join(30)
    return result


def run(quick: bool, repeat: int) -> None:
    key = generate_private_key()
    key_hex = public_key_hex(key)
    print(
        f"{'tile (fp32)':>16} {'frame MB':>9} {'bare MB/s':>10} {'cleave MB/s':>12} "
        f"{'ratio':>6} {'wire/tensor':>12}"
    )
    for side in SIDES:
        a = torch.randn(side, side)
        b = torch.randn(side, side)
        total_mb = 128 if quick else 512
        tensor_bytes = 2 * side * side * 4
        count = max(8, int(total_mb * 2**20 // tensor_bytes))
        blocks = encode_block(a), encode_block(b)
        bundles = [task_frame(f"t{i}", "mm", *blocks, key) for i in range(min(count, 4))]
        frames = [bundles[i % len(bundles)] for i in range(count)]
        raw = [bytes(len(frames[0]))] * count
        bare = ours = 0.0
        for _ in range(repeat):  # interleaved, best of each: the machine's noise hits both
            nbytes, seconds = asyncio.run(_send_all(raw, "bare", key_hex))
            bare = max(bare, nbytes / seconds / 1e6)
            nbytes, seconds = asyncio.run(_send_all(frames, "cleave", key_hex))
            ours = max(ours, nbytes / seconds / 1e6)
        print(
            f"{f'{side}x{side} @ {side}x{side}':>16} {len(frames[0]) / 1e6:>9.2f} {bare:>10.0f} "
            f"{ours:>12.0f} {ours / bare:>6.2f} {len(frames[0]) / tensor_bytes:>12.4f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 MB per run instead of 512")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the best counts")
    args = parser.parse_args()
    run(args.quick, args.repeat)
