"""Seeded device populations: laptops to GPUs, home links with slow uplinks, churn."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Device:
    device_id: str
    claimed_flops: float  # what its start-up benchmark reported (the hello profile)
    true_flops: float  # what it delivers in the simulation (a straggler delivers less)
    mem_cap_bytes: int
    down_bps: float
    up_bps: float
    join_at: float = 0.0
    leave_at: float = math.inf  # clean disconnect: the server sees the socket close
    fail_at: float = math.inf  # silent death: only missed heartbeats reveal it


@dataclass(frozen=True)
class PoolSpec:
    median_gflops: float = 200.0  # a recent laptop CPU; sigma spreads it to GPUs
    gflops_sigma: float = 1.5  # log-normal: ~95% between 10 GFLOP/s and 4 TFLOP/s
    min_gflops: float = 5.0
    max_gflops: float = 100_000.0
    median_down_mbit: float = 100.0
    down_sigma: float = 0.8
    up_ratio: tuple[float, float] = (2.0, 10.0)  # downlink / uplink, uniform
    mem_caps: tuple[int, ...] = (128 << 20, 256 << 20, 512 << 20, 1 << 30)
    leave_rate_per_h: float = 0.0  # per device
    fail_rate_per_h: float = 0.0
    join_rate_per_h: float = 0.0  # extra devices per hour, over the horizon
    horizon_s: float = 3600.0


def make_pool(n: int, seed: int, spec: PoolSpec = PoolSpec()) -> list[Device]:
    rng = random.Random(seed)
    devices = [_device(f"d{i}", rng, spec, join_at=0.0) for i in range(n)]
    if spec.join_rate_per_h > 0:
        t = rng.expovariate(spec.join_rate_per_h / 3600)
        while t < spec.horizon_s:
            devices.append(_device(f"d{len(devices)}", rng, spec, join_at=t))
            t += rng.expovariate(spec.join_rate_per_h / 3600)
    return devices


def _device(device_id: str, rng: random.Random, spec: PoolSpec, *, join_at: float) -> Device:
    gflops = rng.lognormvariate(math.log(spec.median_gflops), spec.gflops_sigma)
    gflops = min(max(gflops, spec.min_gflops), spec.max_gflops)
    down = rng.lognormvariate(math.log(spec.median_down_mbit), spec.down_sigma) * 125_000
    down = min(max(down, 1e6), 1.25e9)
    up = down / rng.uniform(*spec.up_ratio)
    leave = join_at + _exp(rng, spec.leave_rate_per_h)
    fail = join_at + _exp(rng, spec.fail_rate_per_h)
    return Device(
        device_id,
        gflops * 1e9,
        gflops * 1e9,
        rng.choice(spec.mem_caps),
        down,
        up,
        join_at,
        leave,
        fail,
    )


def _exp(rng: random.Random, rate_per_h: float) -> float:
    return rng.expovariate(rate_per_h / 3600) if rate_per_h > 0 else math.inf


def with_stragglers(devices: list[Device], count: int, slowdown: float = 10.0) -> list[Device]:
    """The first `count` devices deliver 1/slowdown of what they claim (busy, throttled)."""
    return [
        replace(d, true_flops=d.claimed_flops / slowdown) if i < count else d
        for i, d in enumerate(devices)
    ]
