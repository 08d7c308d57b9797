"""What the scheduler keeps and hands back: tickets, assignments, verdicts, its config and
stats, and its own per-worker and per-tile records (see coordinator.schedule.scheduler)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.limits import held_tiles_limit


class UnknownWorkerError(KeyError):
    """An operation named a worker that is not (or no longer) registered."""


@dataclass(frozen=True)
class TileTicket:
    tile_id: str
    gemm_id: str
    flops: int
    down_bytes: int
    up_bytes: int
    blocks: tuple[str, ...] = ()  # its operand block ids (see assign's ``prefers``)
    # The worker the planner placed it on: the tile waits for that worker unless another
    # would return it sooner (see coordinator.schedule.scheduler). None: whoever is free.
    planned_for: str | None = None
    # The whole GEMM's FLOPs: what its tiles may be credited in all, however often its
    # step runs (coordinator.pool.payouts). 0: no such bound.
    gemm_flops: int = 0

    def __post_init__(self) -> None:
        if min(self.flops, self.down_bytes, self.up_bytes) < 0:
            raise ValueError(f"tile {self.tile_id!r}: sizes must be >= 0")

    @property
    def wire_bytes(self) -> int:
        """Operands plus result: what must fit in a worker's memory cap."""
        return self.down_bytes + self.up_bytes


@dataclass(frozen=True)
class Assignment:
    worker_id: str
    tile_id: str
    deadline: float
    reissue: bool  # the tile had been assigned before (counts toward stats.reissued)


class Verdict(enum.Enum):
    ACCEPTED = "accepted"  # first valid result for this tile: use it
    DUPLICATE = "duplicate"  # tile already done (speculative or late copy): ignore, no error
    NOT_ASSIGNED = "not_assigned"  # worker never held this tile, or tile unknown: violation


@dataclass(frozen=True)
class Completion:
    verdict: Verdict
    cancel: tuple[str, ...] = ()  # other workers still holding the tile: send them a cancel


@dataclass(frozen=True)
class Expiry:
    dead_workers: tuple[str, ...] = ()  # heartbeat older than the timeout: removed
    requeued: tuple[str, ...] = ()  # tiles queued again, from dead workers and deadlines


@dataclass(frozen=True)
class SchedulerStats:
    submitted: int = 0
    completed: int = 0
    reissued: int = 0
    rejected: int = 0
    duplicates: int = 0
    speculated: int = 0  # copies handed out by speculate() (also counted in reissued)


# Tiles under this many FLOPs (a 128^3 GEMM) share window slots: their frames are small
# enough to go out in batches (``common.batches``), and their compute is shorter than
# the per-message work they would otherwise cost each side.
SHARED_SLOT_FLOPS = 2 * 128**3


@dataclass(frozen=True)
class SchedulerConfig:
    heartbeat_timeout_s: float = 10.0
    tile_timeout_s: float = 120.0  # then the tile is queued again; the holder may still win
    # Speculative copies, off by default. A tile is late when its holders' predicted
    # finish lies more than `speculate_after` times an idle worker's run time in the
    # future: then a copy is worth its bytes. Ratios near 1 burn bandwidth on ties.
    speculate_after: float | None = None
    max_holders: int = 2  # a tile is never held by more workers than this at once
    # Earliest finish: a worker with a free slot leaves a tile in the queue when another
    # worker (busy now, perhaps) is predicted to return it more than this many times
    # sooner; None: off. Needs assign()'s predictions. Fresh tiles only: a re-issued or
    # refused one goes to whoever is free.
    leave_for_faster: float | None = None
    # Small tiles share window slots: a tile of fewer FLOPs than this takes that fraction
    # of a slot, so a worker holds more of them (up to ``held_tiles_limit`` of its window,
    # what the worker itself accepts), and it is refilled once half that many are back,
    # so that they go out together (``common.batches``). None: a tile takes a slot.
    slot_flops: int | None = None

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= 0 or self.tile_timeout_s <= 0:
            raise ValueError("SchedulerConfig timeouts must be > 0")
        if self.speculate_after is not None and self.speculate_after < 1.0:
            raise ValueError("SchedulerConfig.speculate_after must be >= 1 or None")
        if self.max_holders < 1:
            raise ValueError("SchedulerConfig.max_holders must be >= 1")
        if self.leave_for_faster is not None and self.leave_for_faster < 1.0:
            raise ValueError("SchedulerConfig.leave_for_faster must be >= 1 or None")
        if self.slot_flops is not None and self.slot_flops < 1:
            raise ValueError("SchedulerConfig.slot_flops must be >= 1 or None")


@dataclass(frozen=True)
class Holding:
    deadline: float
    seq: int  # identifies this assignment among stale deadline-heap entries


@dataclass(eq=False)
class WorkerRecord:
    worker_id: str
    window: int
    mem_cap_bytes: int | None
    last_seen: float
    incarnation: int  # tells a re-added worker's heartbeat entries from its predecessor's
    slot_flops: int | None = None  # SchedulerConfig.slot_flops
    paused: bool = False
    # Ordered by assignment: each held tile's share of the window, in slot units of
    # ``slot_flops`` FLOPs (1 each without them).
    in_flight: dict[str, int] = field(default_factory=dict)
    held: int = 0  # the sum of in_flight's shares
    # Tiles taken back when the worker paused: a result that was already on its way
    # still counts, so they are remembered until the tile is done or the worker leaves.
    released: set[str] = field(default_factory=set)
    # Tiles recently cancelled for this worker: a result that crossed the cancel is a
    # harmless duplicate even after the tile's GEMM has been forgotten.
    cancelled: dict[str, None] = field(default_factory=dict)
    # Its live entry in the scheduler's turn ring while it is ready (0: not ready).
    turn: int = 0

    def __post_init__(self) -> None:
        self.capacity = self.window * (self.slot_flops or 1)
        # The most tiles it may hold at once, and how many must be back before it is
        # sent more: with shared slots, half of what it accepts, so they go out together.
        self.max_tiles = held_tiles_limit(self.window) if self.slot_flops else self.window
        self.refill_tiles = self.max_tiles // 2 if self.slot_flops else 1

    def share(self, ticket: TileTicket) -> int:
        return min(max(ticket.flops, 1), self.slot_flops) if self.slot_flops else 1

    def has_room(self) -> bool:
        return self.held < self.capacity and len(self.in_flight) < self.max_tiles

    def room_after(self, ticket: TileTicket) -> bool:
        """Room left once it holds ``ticket`` too."""
        return (
            self.held + self.share(ticket) < self.capacity
            and len(self.in_flight) + 1 < self.max_tiles
        )

    def wants_refill(self) -> bool:
        """Room for a slot's worth of tiles, and for half the tiles it may hold."""
        room = self.capacity - self.held
        return (
            room >= (self.slot_flops or 1)
            and self.max_tiles - len(self.in_flight) >= self.refill_tiles
        )

    def hold(self, tile_id: str, ticket: TileTicket) -> None:
        share = self.in_flight[tile_id] = self.share(ticket)
        self.held += share

    def let_go(self, tile_id: str) -> None:
        self.held -= self.in_flight.pop(tile_id)

    def let_go_all(self) -> None:
        self.in_flight.clear()
        self.held = 0

    def can_hold(self, ticket: TileTicket) -> bool:
        return self.mem_cap_bytes is None or ticket.wire_bytes <= self.mem_cap_bytes

    def remember_cancel(self, tile_id: str) -> None:
        self.cancelled[tile_id] = None
        if len(self.cancelled) > 4 * self.window + 16:
            del self.cancelled[next(iter(self.cancelled))]


@dataclass(eq=False)
class TileRecord:
    ticket: TileTicket
    holders: dict[str, Holding] = field(default_factory=dict)
    released_to: set[str] = field(default_factory=set)  # mirror of WorkerRecord.released
    refused_by: set[str] = field(default_factory=set)
    times_assigned: int = 0
    queue_token: int | None = None  # set while queued; matches its one live queue entry

    @property
    def tile_id(self) -> str:
        return self.ticket.tile_id

    def has_live_holder(self, now: float) -> bool:
        return any(h.deadline >= now for h in self.holders.values())


STAT_NAMES = ("submitted", "completed", "reissued", "rejected", "duplicates", "speculated")
