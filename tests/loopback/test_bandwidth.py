"""The bandwidth limit: the token bucket, then a real worker on loopback, both under an
injected clock (``FakeTime``), so every rate is exact however loaded the machine is.
The rate a worker reaches in real time is measured by bench/bench_limits.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from support.fake_coordinator import PROFILE, FakeCoordinator, stop
from support.fake_time import FakeTime, until

from client_app.bandwidth import BYTES_PER_KB, TokenBucket, bytes_per_s
from client_app.config import PinStore, WorkerSettings
from client_app.options import WorkerOptions
from client_app.worker import RunResult, WorkerCore
from common.messages import Result
from common.token_bucket import MIN_BURST as MIN_BURST_BYTES

pytestmark = pytest.mark.timeout(60)


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


# ---- a real worker on loopback, under a fake clock ------------------------------------

# No heartbeats, so no acks: the worker takes in only the frames a test sends.
QUIET_S = 3600.0


def make_core(url: str, config: Path, time: FakeTime, kbps: int, window: int = 2) -> WorkerCore:
    settings = WorkerSettings(
        coordinator_url=url,
        name="bw",
        threads=1,
        use_gpu=False,
        window=window,
        bandwidth_kbps=kbps,
    )
    options = WorkerOptions(profile=PROFILE, clocks=time.clocks())
    return WorkerCore(settings, pin_check=PinStore.in_dir(config).check, options=options)


async def test_worker_takes_in_exactly_its_bandwidth_limit(tmp_path: Path) -> None:
    limit_kbps, n_frames, window = 256, 10, 2
    time = FakeTime()
    async with FakeCoordinator(heartbeat_interval_s=QUIET_S) as coord:
        core = make_core(coord.url, tmp_path, time, limit_kbps, window)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        gen = torch.Generator().manual_seed(0)
        frames = [
            coord.task(f"t-{i}", torch.randn(64, 128, generator=gen), torch.randn(128, 64))
            for i in range(n_frames)
        ]
        # Kept full like a real coordinator keeps a window (64 KiB in, 16 KiB out a tile).
        for frame in frames[:window]:
            await link.send(frame)
        for i in range(n_frames):
            await link.expect(Result)
            if i + window < n_frames:
                await link.send(frames[i + window])
        taken_in = core.status.bytes_in
        assert await stop(core, run) is RunResult.STOPPED
    rate = limit_kbps * BYTES_PER_KB
    burst = TokenBucket(rate).burst
    assert taken_in > sum(len(f) for f in frames) > 2 * burst
    # A wait after each frame paid for every byte past the burst: not a byte early.
    assert time.t - 1000.0 == pytest.approx((taken_in - burst) / rate, rel=1e-9)
    assert len(time.waits) >= n_frames - 1 and time.held == []


async def test_each_result_waits_until_the_upload_limit_allows_it(tmp_path: Path) -> None:
    limit_kbps, n_tiles = 64, 4
    time = FakeTime()
    async with FakeCoordinator(heartbeat_interval_s=QUIET_S) as coord:
        core = make_core(coord.url, tmp_path, time, limit_kbps, window=n_tiles)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        a, b = torch.ones(256, 1), torch.ones(1, 256)  # 2 KiB in (within the burst), 256 KiB out
        for i in range(n_tiles):
            await link.send(coord.task(f"t-{i}", a, b))
        for _ in range(n_tiles):
            await link.expect(Result)
        assert await stop(core, run) is RunResult.STOPPED
    rate = limit_kbps * BYTES_PER_KB
    burst = TokenBucket(rate).burst
    sizes = link.sizes[:n_tiles]
    # Only results waited (the tasks fit the download burst): the first for what it
    # took past the burst, each later one for all of its own bytes.
    assert time.waits == pytest.approx([(sizes[0] - burst) / rate] + [n / rate for n in sizes[1:]])
    assert time.t - 1000.0 == pytest.approx((sum(sizes) - burst) / rate, rel=1e-9)


async def test_bandwidth_limit_can_be_lifted_while_running(tmp_path: Path) -> None:
    time = FakeTime(hold_over_s=1.0)  # a wait over 1 s lasts until the limit changes
    async with FakeCoordinator(heartbeat_interval_s=QUIET_S) as coord:
        core = make_core(coord.url, tmp_path, time, kbps=1)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        # 256 KiB in, 64 bytes out: at 1 KiB/s the receive loop sits out minutes after
        # t-0, while its tiny result passes within the upload burst.
        a, b = torch.zeros(4, 8192), torch.zeros(8192, 4)
        await link.send(coord.task("t-0", a, b))
        await link.send(coord.task("t-1", a, b))
        await link.expect(Result)
        await until(lambda: len(time.held) == 1, "the wait after t-0")
        owed_s = (core.status.bytes_in - MIN_BURST_BYTES) / BYTES_PER_KB
        assert time.held == [pytest.approx(owed_s)] and owed_s > 200
        # From another thread, as the GUI's settings dialog does.
        await asyncio.to_thread(core.set_bandwidth_kbps, 0)
        await link.expect(Result)  # t-1, read at once
        with pytest.raises(ValueError):
            core.set_bandwidth_kbps(-1)
        assert await stop(core, run) is RunResult.STOPPED
    assert time.t == 1000.0 and core.bandwidth_kbps == 0  # the lift ended it, not time
