"""What the coordinator knows of each worker's speed, how it learns it, and when a tile
it holds will be back.

Pure: no torch, no I/O, time comes in as `now`. A worker starts from what it says at
join (GFLOP/s measured at start-up, its memory cap) and link speeds the caller guesses;
every finished tile then moves the estimates toward what was observed, so a worker that
overstated its speed, or got busy, is found out after a few tiles.

A tile's time is modelled as three phases in a row, each bounded by one resource:

    operand bytes / downlink  +  flops / compute speed  +  result bytes / uplink

`LinkModel` says how those phases overlap on a busy worker and what the coordinator's
own uplink adds; placement.py places tiles with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.messages import DeviceProfile

# A worker that reports no measurement still gets work; 1 GFLOP/s is a slow laptop core,
# so the first tiles it gets are small in the plan and its real speed is learnt from them.
UNMEASURED_FLOPS_PER_S = 1e9


@dataclass(frozen=True)
class DeviceEstimate:
    worker_id: str
    flops_per_s: float
    down_bps: float  # coordinator -> worker bytes/s
    up_bps: float  # worker -> coordinator bytes/s
    mem_cap_bytes: int | None = None  # None: no cap
    updated_at: float = 0.0
    link_samples: int = 0  # tiles whose transfer time was measured: 0 = links guessed

    def __post_init__(self) -> None:
        if min(self.flops_per_s, self.down_bps, self.up_bps) <= 0:
            raise ValueError(f"{self.worker_id}: speeds must be > 0")

    def tile_seconds(self, flops: int, down_bytes: int, up_bytes: int) -> float:
        return down_bytes / self.down_bps + flops / self.flops_per_s + up_bytes / self.up_bps

    def pipelined_seconds(self, flops: int, down_bytes: int, up_bytes: int) -> float:
        """What a tile adds to a busy worker's queue when its transfers overlap the
        compute of the tiles around it (a prefetch window of 2 or more): its slowest
        phase."""
        return max(down_bytes / self.down_bps, flops / self.flops_per_s, up_bytes / self.up_bps)

    def can_hold(self, tile_bytes: int) -> bool:
        return self.mem_cap_bytes is None or tile_bytes <= self.mem_cap_bytes


def from_profile(
    worker_id: str, profile: DeviceProfile, *, down_bps: float, up_bps: float, now: float
) -> DeviceEstimate:
    """The estimate at join: the worker's own measurement, the caller's link guesses."""
    flops = profile.gflops * 1e9 if profile.gflops > 0 else UNMEASURED_FLOPS_PER_S
    cap = profile.mem_cap_bytes if profile.mem_cap_bytes > 0 else None
    return DeviceEstimate(worker_id, flops, down_bps, up_bps, cap, now)


@dataclass(frozen=True)
class TileObservation:
    """One finished tile. A phase whose duration was not measured (None or <= 0) leaves
    that rate alone: a zero-byte transfer says nothing about the link."""

    flops: int
    down_bytes: int
    up_bytes: int
    down_s: float | None
    compute_s: float | None
    up_s: float | None


def observe(
    estimate: DeviceEstimate,
    obs: TileObservation,
    now: float,
    *,
    alpha: float = 0.3,
    half_life_s: float = 60.0,
) -> DeviceEstimate:
    """Move each rate toward the observed one (EWMA on rates).

    Back-to-back tiles weigh `alpha` each; an estimate that has not been updated for a
    while is trusted less (its weight halves every `half_life_s`), because the machine's
    load may have changed since.
    """
    if not 0 < alpha <= 1 or half_life_s <= 0:
        raise ValueError("alpha must be in (0, 1] and half_life_s > 0")
    stale = max(0.0, now - estimate.updated_at) / half_life_s
    weight = 1 - (1 - alpha) * 0.5**stale

    measured = obs.down_s is not None and obs.down_s > 0 and obs.down_bytes > 0

    def blend(old: float, amount: int, seconds: float | None) -> float:
        if seconds is None or seconds <= 0 or amount <= 0:
            return old
        return (1 - weight) * old + weight * (amount / seconds)

    return dataclasses.replace(
        estimate,
        flops_per_s=blend(estimate.flops_per_s, obs.flops, obs.compute_s),
        down_bps=blend(estimate.down_bps, obs.down_bytes, obs.down_s),
        up_bps=blend(estimate.up_bps, obs.up_bytes, obs.up_s),
        updated_at=max(now, estimate.updated_at),
        link_samples=estimate.link_samples + measured,
    )


def for_planning(estimate: DeviceEstimate, optimistic_bps: float) -> DeviceEstimate:
    """The estimate a planner should use. Links nobody has measured yet are assumed fast:
    a planner that believed the cautious guess would keep every tile at the coordinator,
    no tile would ever cross the link, and the guess would never be corrected. One slow
    first tile (which the speculative copies cover) is the price of finding out."""
    if estimate.link_samples:
        return estimate
    return dataclasses.replace(
        estimate,
        down_bps=max(estimate.down_bps, optimistic_bps),
        up_bps=max(estimate.up_bps, optimistic_bps),
    )


def queued_start(sent_at: float, last_result_at: float) -> float:
    """When a held tile's round trip effectively began, for overdue_finish: its send
    time, or the worker's last result if that came later. A worker computes one tile at
    a time, so a tile sent while another was computing waited until that one was back;
    counting from its send time would call it nearly done when it has barely begun."""
    return max(sent_at, last_result_at)


def overdue_finish(start: float, expected_s: float, now: float) -> float:
    """When a tile started at `start` will be back. Once it is past its expected time the
    estimate is evidently wrong; assume it needs as long again as it has already taken
    (the doubling guess of a job whose remaining time is unknown)."""
    expected = start + expected_s
    return expected if now <= expected else now + (now - start)


def lower_bound(total_flops: int, devices: Sequence[DeviceEstimate]) -> float:
    """No schedule beats total work / total speed (communication ignored)."""
    speed = sum(d.flops_per_s for d in devices)
    if speed <= 0:
        raise ValueError("lower_bound needs at least one device")
    return total_flops / speed


@dataclass(frozen=True)
class LinkModel:
    """How a worker's transfers overlap its compute, and the coordinator's own uplink.

    `window` is how many tiles a worker may hold at once (the scheduler's prefetch
    window): with 1, download, compute and upload run in a row; with 2 (the server's
    default), the next tile downloads while this one computes, so a busy worker's tile
    costs the slowest of its three phases, not their sum. Every download also passes the
    coordinator's uplink, `egress_bps`, modelled as a shared pipe: the downloads placed
    so far cannot all have ended before it carried their bytes.
    """

    window: int = 1
    egress_bps: float = math.inf
    # The coordinator's own work per tile sent (cut, sign, frame, check the result), one
    # tile at a time: what makes many small tiles slower than a few big ones.
    tile_overhead_s: float = 0.0
    # ...and per byte a tile moves, operands sent and result back (cut, hash, send,
    # receive, check): what makes a grid that sends a block to two workers slower than
    # one that sends it once, where the coordinator's CPU binds.
    byte_cpu_s: float = 0.0

    def __post_init__(self) -> None:
        if (
            self.window < 1
            or self.egress_bps <= 0
            or self.tile_overhead_s < 0
            or self.byte_cpu_s < 0
        ):
            raise ValueError(
                "window must be >= 1, egress_bps > 0, tile_overhead_s and byte_cpu_s >= 0"
            )


SEQUENTIAL = LinkModel()
