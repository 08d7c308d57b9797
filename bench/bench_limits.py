"""The owner's limits, measured in real time: how close a worker comes to them.

The test suite checks the limits exactly on an injected clock (tests/loopback/test_worker_duty.py,
tests/loopback/test_bandwidth.py), where no load on the machine can move a figure. What a real
worker reaches in real time, with the CPU time the OS accounts and the bytes a socket
carries, is measured here, each figure as a ratio to its target, with a real
``WorkerCore`` on the loopback fake coordinator. Run on a quiet machine:
``python bench/bench_limits.py``.
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from support.fake_coordinator import PROFILE, FakeCoordinator, Link, stop  # noqa: E402

from client_app.bandwidth import BYTES_PER_KB, TokenBucket  # noqa: E402
from client_app.compute import TileComputer  # noqa: E402
from client_app.config import PinStore, WorkerSettings  # noqa: E402
from client_app.options import WorkerOptions  # noqa: E402
from client_app.worker import WorkerCore  # noqa: E402
from common.messages import Result  # noqa: E402

TILE_CPU_S = 0.03  # each tile burns this much CPU time on the compute thread


class BurningComputer(TileComputer):
    """Computes the real tile, then burns a fixed CPU time in fp32 matmuls.

    Burning CPU time (not wall time) keeps every tile's work the same when other
    programs compete for the cores; tiny operands keep the wire and signature work
    negligible.
    """

    def __init__(self) -> None:
        super().__init__(1, use_gpu=False)
        self.burned_cpu_s = 0.0  # the compute thread's own CPU time in tiles
        self._x = torch.randn(128, 128)

    def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        cpu0 = time.thread_time()
        c = super().compute(op, a, b)
        while time.thread_time() - cpu0 < TILE_CPU_S:
            torch.matmul(self._x, self._x)
        self.burned_cpu_s += time.thread_time() - cpu0
        return c


async def keep_supplied(coord: FakeCoordinator, link: Link, window: int = 2) -> None:
    """Hold the worker's window full: a new tile for every result, forever."""
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    # Signed ahead of time so that the fake coordinator's own CPU barely shows.
    frames = iter([coord.task(f"t-{i}", a, b) for i in range(2000)])
    for _ in range(window):
        await link.send(next(frames))
    while True:
        await link.expect(Result)
        await link.send(next(frames))


def measure_cpu(percent: int, config: Path, seconds: float = 4.0) -> float:
    """The share of one core a worker kept supplied with tiles used at ``percent``:
    its compute thread plus its event-loop thread (which also runs the tiny fake
    coordinator), over ``seconds`` after a warm-up."""

    async def scenario() -> float:
        async with FakeCoordinator(heartbeat_interval_s=0.1) as coord:
            computer = BurningComputer()
            settings = WorkerSettings(
                coordinator_url=coord.url, threads=1, use_gpu=False, cpu_percent=percent
            )
            options = WorkerOptions(computer=computer, profile=PROFILE, rng=random.Random(0))
            core = WorkerCore(settings, pin_check=PinStore.in_dir(config).check, options=options)
            run = asyncio.create_task(core.run())
            link = await coord.next_link()
            feeder = asyncio.create_task(keep_supplied(coord, link))
            await asyncio.sleep(1.0)  # warm-up: torch's first matmuls, the first rests
            wall0, loop0, burned0 = time.perf_counter(), time.thread_time(), computer.burned_cpu_s
            await asyncio.sleep(seconds)
            wall = time.perf_counter() - wall0
            used = computer.burned_cpu_s - burned0 + time.thread_time() - loop0
            feeder.cancel()
            await stop(core, run)
        return used / wall

    return asyncio.run(scenario())


def measure_receive_rate(limit_kbps: int, config: Path, n_frames: int = 10) -> float:
    """Bytes per second a worker limited to ``limit_kbps`` took in, keeping its window
    full like a real coordinator (a burst's worth passes at once, and the last frame is
    answered before the wait it causes: both are left out)."""
    window = 2

    async def scenario() -> float:
        async with FakeCoordinator() as coord:
            settings = WorkerSettings(
                coordinator_url=coord.url,
                threads=1,
                use_gpu=False,
                window=window,
                bandwidth_kbps=limit_kbps,
            )
            options = WorkerOptions(profile=PROFILE)
            core = WorkerCore(settings, pin_check=PinStore.in_dir(config).check, options=options)
            run = asyncio.create_task(core.run())
            link = await coord.next_link()
            gen = torch.Generator().manual_seed(0)
            frames = [
                coord.task(f"t-{i}", torch.randn(64, 128, generator=gen), torch.randn(128, 64))
                for i in range(n_frames)
            ]
            start = time.monotonic()
            for frame in frames[:window]:
                await link.send(frame)
            for i in range(n_frames):
                await link.expect(Result)
                if i + window < n_frames:
                    await link.send(frames[i + window])
            elapsed = time.monotonic() - start
            await stop(core, run)
        burst = TokenBucket(limit_kbps * BYTES_PER_KB).burst
        return (sum(len(f) for f in frames[:-1]) - burst) / elapsed

    return asyncio.run(scenario())


def main() -> None:
    print(f"{'limit':>24} {'target':>10} {'measured':>10} {'ratio':>6}")
    for percent in (25, 50, 100):
        with tempfile.TemporaryDirectory() as tmp:
            used = measure_cpu(percent, Path(tmp))
        target = percent / 100
        print(f"{f'CPU time {percent}%':>24} {target:>10.3f} {used:>10.3f} {used / target:>6.2f}")
    for kbps in (128, 256, 1024):
        with tempfile.TemporaryDirectory() as tmp:
            rate = measure_receive_rate(kbps, Path(tmp), n_frames=10 if kbps < 1024 else 30)
        target = kbps * BYTES_PER_KB
        print(
            f"{f'download {kbps} KiB/s':>24} {target / 1e3:>9.0f}k {rate / 1e3:>9.0f}k "
            f"{rate / target:>6.2f}"
        )
    print("(CPU time: the worker's compute and event-loop threads over the window, one thread)")


if __name__ == "__main__":
    main()
