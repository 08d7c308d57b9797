"""The simulated pool's side: each device's tiles on its links and compute, and the
stand-ins for tiles (sizes, no data) that the coordinator's core schedules."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.schedule.scheduler import TileTicket
from coordinator.sim.population import Device


@dataclass(eq=False)
class Run:
    """One tile on one device: its timeline, re-planned when a tile ahead of it goes."""

    ticket: TileTicket
    assigned: float
    down_start: float
    down_end: float
    comp_start: float = 0.0
    comp_end: float = 0.0
    up_start: float = 0.0
    up_end: float = 0.0
    token: int = 0
    down_bytes: int = 0  # operand bytes actually sent (less the blocks the device held)

    def computed_part(self, now: float) -> int:
        """FLOPs of it done by ``now`` (what a cancel or a death wastes)."""
        if now <= self.comp_start:
            return 0
        if now >= self.comp_end:
            return self.ticket.flops
        done = (now - self.comp_start) / (self.comp_end - self.comp_start)
        return int(self.ticket.flops * done)


@dataclass(eq=False)
class DeviceState:
    device: Device
    registered: bool = False
    alive: bool = True
    runs: dict[str, Run] = field(default_factory=dict)  # tile_id -> run, FIFO order
    down_free: float = 0.0
    comp_free: float = 0.0
    up_free: float = 0.0
    down_bytes: int = 0
    up_bytes: int = 0
    saved_bytes: int = 0  # operand bytes not sent because the device held the block
    useful_flops: int = 0
    wasted_flops: int = 0  # computed, then cancelled or lost

    def replan(self, now: float) -> list[tuple[float, str, int]]:
        """Lay the device's tiles on its compute and uplink again from ``now``: stages
        already started keep their times, the rest move up into freed time. Returns the
        result events that changed: (when, tile id, token)."""
        device = self.device
        moved = []
        comp_free = up_free = now
        for tile_id, run in self.runs.items():
            if run.comp_start <= now:
                comp_free = max(comp_free, run.comp_end)
                comp_end = run.comp_end
                comp_start = run.comp_start
            else:
                comp_start = max(run.down_end, comp_free)
                comp_end = comp_start + run.ticket.flops / device.true_flops
                comp_free = comp_end
            if run.up_start <= now and run.comp_start <= now and run.up_end > 0:
                up_free = max(up_free, run.up_end)
                up_start, up_end = run.up_start, run.up_end
            else:
                up_start = max(comp_end, up_free)
                up_end = up_start + run.ticket.up_bytes / device.up_bps
                up_free = up_end
            if (comp_start, up_end) != (run.comp_start, run.up_end):
                run.comp_start, run.comp_end = comp_start, comp_end
                run.up_start, run.up_end = up_start, up_end
                run.token += 1
                moved.append((up_end, tile_id, run.token))
        self.comp_free, self.up_free = comp_free, up_free
        return moved


@dataclass(frozen=True)
class SimFrame:
    """A task frame's stand-in: only its size travels the simulated links."""

    nbytes: int

    def __len__(self) -> int:
        return self.nbytes


@dataclass(eq=False)
class SimGemm:
    gemm_id: str
    remaining: int = 0  # its tiles still out (the coordinator's share is not counted)


@dataclass(eq=False)
class SimTile:
    """One tile as ``CoordinatorCore`` sees it (``coordinator.pool.core.Tile``), without data."""

    tile_id: str
    ticket: TileTicket
    blocks: tuple[str, str]
    sizes: tuple[int, int]  # A and B block bytes
    itemsize: int
    gemm: SimGemm

    @property
    def flops(self) -> int:
        return self.ticket.flops

    @property
    def bundle(self) -> SimFrame:
        return SimFrame(self.ticket.down_bytes)

    @property
    def half(self) -> bool:
        return self.itemsize == 2

    def block_bytes(self) -> tuple[int, int]:
        return self.sizes

    def task_frame(self, refs: frozenset[str], key: object) -> SimFrame:
        held = sum(size for name, size in zip("ab", self.sizes, strict=True) if name in refs)
        return SimFrame(self.ticket.down_bytes - held)
