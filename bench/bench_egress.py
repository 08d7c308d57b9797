"""Coordinator egress: tile bytes sent per coordinator CPU-second, against bare websockets.

One coordinator process (this one) serves workers in other processes on 127.0.0.1:

- bare:   a websockets server sends pre-built frames of a tile's size to 2 receiver
          processes, each keeping a window of them in flight and answering each with a
          frame of the result's size: the same bytes each way, and no protocol work.
- cleave: the real ``CoordinatorServer`` and 2 real ``cleave-worker`` processes (1
          thread each). GEMMs are cut into side x side @ side x side tiles by
          ``TiledGemm.iter_tiles`` on a thread of their own, as the training thread does
          (slice, copy into the frame, hash each block once, sign), and submitted to the
          server, which picks each worker's task frame (operands it holds by reference),
          sends it, receives the result and has it checked (Freivalds) on its check thread.

Reported per tile size: MB of task frames sent per CPU-second of this process, for the
bare sink and for Cleave, counting all of Cleave's threads ("all") or only the send path
("send": the event loop and the cutting thread, leaving out the result checks), and
the ratios to bare. CPU time, not wall time: the workers' matmuls share this machine's
cores and set the pace, but cost the coordinator nothing.

Run: ``python bench/bench_egress.py`` (``--quick`` for fewer tiles). Profile the
coordinator side with ``py-spy record --subprocesses -o egress.svg -- python
bench/bench_egress.py --quick``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402
import torch  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402
from websockets.asyncio.server import ServerConnection, serve  # noqa: E402

from common.signing import generate_private_key  # noqa: E402
from coordinator.plan.planner import GemmShape, PlanConfig, plan_gemm  # noqa: E402
from coordinator.pool.ledger import Ledger  # noqa: E402
from coordinator.serve.gc_policy import settle_after_start  # noqa: E402
from coordinator.serve.local_workers import LocalWorkers  # noqa: E402
from coordinator.serve.server import CoordinatorServer, ServerConfig  # noqa: E402
from coordinator.tiles.tiled_gemm import TiledGemm  # noqa: E402

SIDES = (256, 512, 1024)
GRID = 4  # a GEMM is GRID x GRID tiles: each row block of A and column block of B is shared
WORKERS = 2
WINDOW = 2  # the worker's default prefetch window


class CpuMeter:
    """CPU seconds of this process, and of its event loop thread, between start and stop."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._loop_thread = threading.get_native_id()

    def _read(self) -> tuple[float, float]:
        times = self._proc.cpu_times()
        threads = self._proc.threads()
        loop = sum(t.user_time + t.system_time for t in threads if t.id == self._loop_thread)
        return times.user + times.system, loop

    def start(self) -> None:
        self._t0 = self._read()

    def stop(self) -> tuple[float, float]:
        total, loop = self._read()
        return total - self._t0[0], loop - self._t0[1]


# ---- bare websockets --------------------------------------------------------------------


def _bare_receiver(port: int, up_bytes: int) -> None:
    async def main() -> None:
        reply = bytes(up_bytes)
        async with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
            async for _ in ws:
                await ws.send(reply)

    asyncio.run(main())


async def bare(down_bytes: int, up_bytes: int, frames: int) -> tuple[int, float]:
    """Bytes sent and this process's CPU seconds for ``frames`` request/reply pairs."""
    frame = bytes(down_bytes)
    per_conn = frames // WORKERS
    meter = CpuMeter()
    finished = 0
    all_done = asyncio.Event()

    async def handler(ws: ServerConnection) -> None:
        nonlocal finished
        sent = replies = 0
        while sent < min(WINDOW, per_conn):
            await ws.send(frame)
            sent += 1
        async for _ in ws:
            replies += 1
            if sent < per_conn:
                await ws.send(frame)
                sent += 1
            elif replies == per_conn:
                break
        finished += 1
        if finished == WORKERS:
            all_done.set()

    ctx = mp.get_context("spawn")
    async with serve(handler, "127.0.0.1", 0, compression=None, max_size=None) as server:
        port = server.sockets[0].getsockname()[1]
        procs = [ctx.Process(target=_bare_receiver, args=(port, up_bytes)) for _ in range(WORKERS)]
        for proc in procs:
            proc.start()
        meter.start()
        await asyncio.wait_for(all_done.wait(), 600)
        cpu, _ = meter.stop()
    for proc in procs:
        proc.terminate()
        proc.join(10)
    return per_conn * WORKERS * down_bytes, cpu


# ---- Cleave -------------------------------------------------------------------------------


async def cleave(side: int, gemms: int, state: Path) -> tuple[int, float, float, int]:
    """Task bytes sent, CPU seconds (all, send path) and tiles for ``gemms`` GEMMs."""
    key = generate_private_key()
    ledger = Ledger(state / "ledger.sqlite")
    server = CoordinatorServer(key=key, job_name="egress", ledger=ledger, config=ServerConfig())
    port = await server.start("127.0.0.1", 0)
    settle_after_start()  # as the coordinator's process does once it listens
    workers = LocalWorkers(WORKERS, f"ws://127.0.0.1:{port}/ws", state, threads=1)
    workers.start()
    loop = asyncio.get_running_loop()
    meter = CpuMeter()
    cut_cpu = 0.0  # the cutting thread's own CPU seconds (it ends before the meter reads)
    try:
        await asyncio.wait_for(server.wait_for_workers(WORKERS), 120)
        m = n = GRID * side
        plan = plan_gemm(
            GemmShape("mm", 1, m, n, side, 4),
            PlanConfig(min_offload_flops=1, min_tile_flops=1, target_tiles=GRID * GRID),
        )
        assert plan is not None and plan.grid == (1, GRID, GRID, 1), plan
        gen = torch.Generator().manual_seed(0)
        # New data for every GEMM, as a step's activations are: a block a worker still
        # holds would go by reference and the bench would measure the operand cache.
        base_a, base_b = torch.randn(m, side, generator=gen), torch.randn(side, n, generator=gen)
        operands = [(base_a + g, base_b - g) for g in range(gemms)]
        done = asyncio.Semaphore(0)
        ahead = threading.Semaphore(2)  # GEMMs out at once, as a step's data flow allows
        tiles = 0

        def finished(_: object) -> None:
            ahead.release()
            loop.call_soon_threadsafe(done.release)

        def cut() -> None:
            nonlocal tiles, cut_cpu
            started = time.thread_time()
            for g in range(gemms):
                a, b = operands[g]
                ahead.acquire()
                gemm = TiledGemm(f"g{g}", plan, a, b, finished)
                for job in gemm.iter_tiles(key):
                    tiles += 1
                    loop.call_soon_threadsafe(server.submit, [job])
            cut_cpu = time.thread_time() - started

        sent_before = server.counters.bytes_down
        meter.start()
        cutter = threading.Thread(target=cut, name="cut")
        cutter.start()
        for _ in range(gemms):
            await asyncio.wait_for(done.acquire(), 600)
        cpu_all, cpu_loop = meter.stop()
        cutter.join()
        return server.counters.bytes_down - sent_before, cpu_all, cpu_loop + cut_cpu, tiles
    finally:
        workers.stop()
        await server.close()
        ledger.close()


def run(quick: bool) -> None:
    torch.set_num_threads(1)
    print(
        f"{'tile (fp32)':>18} {'tiles':>6} {'bare MB/cpu-s':>14} {'cleave all':>11} "
        f"{'cleave send':>12} {'all/bare':>9} {'send/bare':>10}"
    )
    for side in SIDES:
        down = 2 * side * side * 4
        up = side * side * 4
        total_mb = 128 if quick else 512
        gemms = max(2, int(total_mb * 2**20 // (down * GRID * GRID)))
        with tempfile.TemporaryDirectory() as tmp:
            sent, cpu_all, cpu_send, tiles = asyncio.run(cleave(side, gemms, Path(tmp)))
        # The bare sink sends as many bytes in as many frames (the operand cache makes
        # some of Cleave's frames smaller than a whole tile).
        bare_bytes, bare_cpu = asyncio.run(bare(sent // tiles, up, tiles))
        base = bare_bytes / bare_cpu / 1e6
        ours_all, ours_send = sent / cpu_all / 1e6, sent / cpu_send / 1e6
        print(
            f"{f'{side}x{side} @ {side}x{side}':>18} {tiles:>6} {base:>14.0f} {ours_all:>11.0f} "
            f"{ours_send:>12.0f} {ours_all / base:>9.2f} {ours_send / base:>10.2f}"
        )
    print(
        f"(MB of task frames sent per CPU-second of the coordinator process; {WORKERS} "
        f"receivers, window {WINDOW}; {psutil.cpu_count()} cores)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 MB per size instead of 512")
    run(parser.parse_args().quick)
