"""The real worker's tile rate vs bare ``torch.matmul`` on the same tiles, in one run.

``bench_tile.py`` times the worker's steps on threads of its own; this runs the worker
itself (``WorkerCore``: its event loop receiving, checking and answering tiles, its
compute thread multiplying them) against a fake coordinator in another process on
127.0.0.1, which keeps the worker's window full (a new task for every result, signed
ahead of time so that its own CPU barely shows). The ratio is the worker's tiles/s
over bare ``torch.matmul(a, b, out=c)`` tiles/s in the same round; *idle* is the
compute thread's median wait between two GEMMs. Each round runs bare, then the worker;
the table shows medians over rounds.

*device-bound* rows stand for a device that multiplies while the compute thread waits
with the GIL released (a GPU): a small GEMM, then a sleep of the given time, in bare and
in the worker alike. There the event loop has a core to itself, and the compute
thread's idle time between tiles is what the worker's hand-off costs.

On a 2-core machine the fake coordinator shares a core with the worker's event loop:
the CPU-bound rows then measure that contention as much as the worker. Run:
``python bench/bench_worker.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from support.fake_coordinator import PROFILE, FakeCoordinator, stop  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402

from client_app.compute import TileComputer  # noqa: E402
from client_app.config import PinStore, WorkerSettings  # noqa: E402
from client_app.options import WorkerOptions  # noqa: E402
from client_app.worker import WorkerCore  # noqa: E402
from common.messages import Result  # noqa: E402

CASES = [  # (n: an n x n x n fp32 GEMM, seconds the device takes after it)
    (512, 0.0),
    (1024, 0.0),
    (128, 0.002),
    (128, 0.005),
]


def _feed(conn: Connection, n: int, window: int) -> None:
    """The fake coordinator's process: sends the worker's URL, then a task for every
    result, ``window`` of them ahead, until the worker leaves."""
    torch.set_num_threads(1)

    async def main() -> None:
        async with FakeCoordinator(heartbeat_interval_s=5.0) as coord:
            a, b = torch.randn(n, n), torch.randn(n, n)
            frames = [coord.task(f"t-{i}", a, b) for i in range(64)]
            conn.send(coord.url)
            link = await coord.next_link(30)
            sent = 0
            try:
                for sent in range(window):
                    await link.send(frames[sent])
                while True:
                    await link.expect(Result, 30)
                    sent += 1
                    await link.send(frames[sent % len(frames)])
            except (AssertionError, asyncio.TimeoutError, ConnectionClosed):
                return  # the worker said bye, or left

    asyncio.run(main())


class _Timed(TileComputer):
    """The worker's computer, timing each GEMM (and the device's time after it)."""

    def __init__(self, device_s: float) -> None:
        super().__init__(1, use_gpu=False)
        self.device_s = device_s
        self.spans: list[tuple[float, float]] = []

    def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        c = super().compute(op, a, b)
        if self.device_s:
            time.sleep(self.device_s)
        self.spans.append((start, time.perf_counter()))
        return c


def _bare(n: int, device_s: float, seconds: float) -> float:
    """Tiles/s of bare matmul into a reused product (and the device's wait)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    product = a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.matmul(a, b, out=product)
        if device_s:
            time.sleep(device_s)
        count += 1
    return count / (time.perf_counter() - start)


def _worker(url: str, device_s: float, seconds: float, pins: Path) -> tuple[float, float]:
    """The worker's tiles/s once warm, and the compute thread's median idle between
    GEMMs (seconds)."""

    async def scenario() -> tuple[float, float]:
        computer = _Timed(device_s)
        settings = WorkerSettings(coordinator_url=url, threads=1, use_gpu=False)
        options = WorkerOptions(computer=computer, profile=PROFILE, rng=random.Random(0))
        core = WorkerCore(settings, pin_check=PinStore.in_dir(pins).check, options=options)
        run = asyncio.create_task(core.run())
        await asyncio.sleep(1.0)  # joined, torch warm
        first, start = len(computer.spans), time.perf_counter()
        await asyncio.sleep(seconds)
        last, wall = len(computer.spans), time.perf_counter() - start
        await stop(core, run)
        spans = computer.spans[first:last]
        idle = [after[0] - before[1] for before, after in zip(spans, spans[1:], strict=False)]
        return (last - first) / wall, statistics.median(idle) if idle else float("nan")

    return asyncio.run(scenario())


def bench_case(
    n: int, device_s: float, window: int, seconds: float, rounds: int, tmp: Path
) -> tuple[float, float, float]:
    """Bare tiles/s, the worker's ratio to it and its idle between GEMMs (medians)."""
    bares, ratios, idles = [], [], []
    spawn = multiprocessing.get_context("spawn")
    for r in range(rounds):
        parent, child = spawn.Pipe()
        feeder = spawn.Process(target=_feed, args=(child, n, window), daemon=True)
        feeder.start()
        try:
            url = parent.recv()
            bare = _bare(n, device_s, seconds)
            rate, idle = _worker(url, device_s, seconds, tmp / f"{n}-{device_s}-{r}")
        finally:
            feeder.kill()
            feeder.join()
        bares.append(bare)
        ratios.append(rate / bare)
        idles.append(idle)
    return statistics.median(bares), statistics.median(ratios), statistics.median(idles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--window", type=int, default=2, help="tiles the worker holds")
    args = parser.parse_args()
    seconds, rounds = (1.0, 1) if args.quick else (3.0, 3)
    torch.set_num_threads(1)
    print(f"{'tile':>24} {'bare tiles/s':>13} {'worker ratio':>13} {'idle between GEMMs':>19}")
    with tempfile.TemporaryDirectory() as tmp:
        for n, device_s in CASES:
            bare, ratio, idle = bench_case(n, device_s, args.window, seconds, rounds, Path(tmp))
            label = f"{n}³ fp32" + (f" + {device_s * 1e3:g} ms device" if device_s else "")
            print(f"{label:>24} {bare:>13.1f} {ratio:>13.2f} {idle * 1e3:>16.2f} ms")
    print(
        f"(medians over {rounds} rounds of {seconds:g} s each for bare and the worker; "
        f"window {args.window}; 1 compute thread; the fake coordinator in its own process)"
    )


if __name__ == "__main__":
    main()
