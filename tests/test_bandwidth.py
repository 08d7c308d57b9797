"""The bandwidth limit: the token bucket with a fake clock, then a real worker on loopback."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from client_app.bandwidth import BYTES_PER_KB, TokenBucket, bytes_per_s
from client_app.config import PinStore, WorkerSettings
from client_app.worker import WorkerCore
from common.messages import Result
from common.token_bucket import MIN_BURST as MIN_BURST_BYTES
from tests.test_worker_loopback import PROFILE, FakeCoordinator, stop


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_bucket_waits_exactly_what_the_debt_takes_to_repay() -> None:
    clock = FakeClock()
    bucket = TokenBucket(1000.0, burst=500.0, clock=clock)
    assert bucket.reserve(500) == 0.0  # starts full: a burst passes at once
    assert bucket.reserve(250) == pytest.approx(0.25)
    clock.t += 0.25
    assert bucket.wait_s() == 0.0
    # A frame larger than the burst is allowed and paid back afterwards.
    assert bucket.reserve(3000) == pytest.approx(3.0)
    clock.t += 1.0
    assert bucket.wait_s() == pytest.approx(2.0)
    clock.t += 10.0  # idle time refills only up to the burst
    assert bucket.reserve(500) == 0.0
    assert bucket.reserve(100) == pytest.approx(0.1)


def test_bucket_rate_changes_apply_to_the_debt_and_zero_means_unlimited() -> None:
    clock = FakeClock()
    bucket = TokenBucket(1000.0, burst=0.0, clock=clock)
    assert bucket.reserve(1000) == pytest.approx(1.0)
    bucket.set_rate(4000.0)
    assert bucket.wait_s() == pytest.approx(0.25)
    bucket.set_rate(0.0)
    assert bucket.wait_s() == 0.0 and bucket.reserve(10**9) == 0.0
    bucket.set_rate(1000.0)  # the debt was forgiven while unlimited
    assert bucket.wait_s() == 0.0


def test_clock_stepping_back_earns_nothing_and_bad_inputs_are_refused() -> None:
    clock = FakeClock()
    bucket = TokenBucket(100.0, burst=0.0, clock=clock)
    assert bucket.reserve(100) == pytest.approx(1.0)
    clock.t -= 50.0
    assert bucket.wait_s() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bucket.reserve(-1)
    with pytest.raises(ValueError):
        bucket.set_rate(-1.0)
    with pytest.raises(ValueError):
        bytes_per_s(-5)
    assert bytes_per_s(3) == 3 * BYTES_PER_KB


def test_default_burst_is_a_quarter_second_but_never_tiny() -> None:
    assert TokenBucket(8 * 1024 * 1024).burst == 2 * 1024 * 1024
    assert TokenBucket(1024).burst == MIN_BURST_BYTES


def test_settings_validate_the_limit() -> None:
    assert WorkerSettings().bandwidth_kbps == 0
    with pytest.raises(ValueError, match="bandwidth_kbps"):
        WorkerSettings(bandwidth_kbps=-1)


def measure_receive_rate(limit_kbps: int, config: Path, n_frames: int = 10) -> float:
    """Bytes per second a worker limited to ``limit_kbps`` took in, keeping its window
    full like a real coordinator (a burst's worth passes at once, and the last frame is
    answered before the wait it causes: both are left out)."""
    window = 2

    async def scenario() -> tuple[float, int]:
        async with FakeCoordinator() as coord:
            settings = WorkerSettings(
                coordinator_url=coord.url,
                name="bw",
                threads=1,
                use_gpu=False,
                window=window,
                bandwidth_kbps=limit_kbps,
            )
            core = WorkerCore(settings, pin_check=PinStore.in_dir(config).check, profile=PROFILE)
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
            arrivals = []
            for i in range(n_frames):
                received = await link.expect(Result)
                assert isinstance(received.message, Result)
                arrivals.append(time.monotonic())
                if i + window < n_frames:
                    await link.send(frames[i + window])
            await stop(core, run)
            burst = TokenBucket(limit_kbps * BYTES_PER_KB).burst
            return arrivals[-1] - start, sum(len(f) for f in frames[:-1]) - int(burst)

    elapsed, carried = asyncio.run(scenario())
    return carried / elapsed


@pytest.mark.timeout(30)
def test_worker_receives_no_faster_than_its_bandwidth_limit(tmp_path: Path) -> None:
    limit_kbps = 256
    rate = measure_receive_rate(limit_kbps, tmp_path)
    # Faster than the limit is a bug; slower, only a loaded machine (the rate reached is
    # measured by bench/bench_limits.py).
    assert rate <= 1.2 * limit_kbps * BYTES_PER_KB, (rate, limit_kbps)


def test_bandwidth_limit_can_be_lifted_while_running(tmp_path: Path) -> None:
    async def scenario() -> float:
        async with FakeCoordinator() as coord:
            settings = WorkerSettings(
                coordinator_url=coord.url, name="bw", threads=1, use_gpu=False, bandwidth_kbps=1
            )
            core = WorkerCore(settings, pin_check=PinStore.in_dir(tmp_path).check, profile=PROFILE)
            run = asyncio.create_task(core.run())
            link = await coord.next_link()
            # 256 KiB in, 64 bytes out: at 1 KiB/s the receive loop would sit out minutes
            # after t-0, while its tiny result passes within the upload burst.
            a, b = torch.zeros(4, 8192), torch.zeros(8192, 4)
            await link.send(coord.task("t-0", a, b))
            await link.send(coord.task("t-1", a, b))
            await link.expect(Result)
            start = time.monotonic()
            core.set_bandwidth_kbps(0)
            await link.expect(Result)
            lifted_after = time.monotonic() - start
            with pytest.raises(ValueError):
                core.set_bandwidth_kbps(-1)
            await stop(core, run)
            return lifted_after

    # At 1 KiB/s the second tile's 256 KiB would take minutes.
    assert asyncio.run(scenario()) < 30.0
