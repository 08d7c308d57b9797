"""The core's state: each connected worker as the core knows it, the run's counters, the
pool view the planner reads, and the tile interface the core schedules."""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.block_cache import BlockCache
from common.messages import DeviceProfile, JobState
from common.signing import fingerprint
from common.token_bucket import TokenBucket
from coordinator.plan.estimates import DeviceEstimate, TileObservation, observe
from coordinator.schedule.scheduler import TileTicket


class WorkerState(str, Enum):
    """What a worker said it is doing (``common.messages.WORKER_STATES``)."""

    WORKING = "working"
    IDLE = "idle"
    PAUSED = "paused"


class Tile(Protocol):
    """One tile as the core needs it: ``coordinator.tiles.tiled_gemm.SignedTile`` on the server, a
    sized stand-in in the simulator."""

    tile_id: str
    ticket: TileTicket
    blocks: tuple[str, str]

    @property
    def flops(self) -> int: ...

    @property
    def bundle(self) -> Sized: ...

    @property
    def half(self) -> bool: ...

    def block_bytes(self) -> tuple[int, int]: ...

    def task_frame(self, refs: frozenset[str], key: Ed25519PrivateKey) -> Sized: ...


@dataclass
class Worker:
    """One connected worker, as the core knows it."""

    worker_id: str  # this connection
    key: str  # the worker's proven public key (hex): its identity in the ledger
    name: str
    profile: DeviceProfile
    window: int
    connected_at: float
    state: WorkerState = WorkerState.WORKING
    reason: str = ""
    last_seen: float = 0.0
    tiles_session: int = 0
    refused: int = 0
    # When each in-flight tile was sent: a worker's claimed compute time is credited
    # no higher than the time it actually held the tile.
    sent_at: dict[str, float] = field(default_factory=dict)
    verifying: set[str] = field(default_factory=set)  # results being checked right now
    messages: TokenBucket | None = None  # this connection's message-rate allowance
    # Tiles sent while the worker held nothing: their round trip is all transfer and
    # compute, no waiting behind another tile, so they measure the links.
    sent_idle: set[str] = field(default_factory=set)
    estimate: DeviceEstimate | None = None  # speed and links, learnt from its tiles
    # The worker's operand cache, mirrored: block id -> bytes, least recently used first,
    # kept in the same order and budget as the worker keeps it (client_app.operands).
    blocks: BlockCache[str, int] = field(default_factory=lambda: BlockCache(0, int))
    sent_bytes: dict[str, int] = field(default_factory=dict)  # tile id -> bytes it cost
    # When its last result arrived: a tile sent while another was computing starts its
    # own compute no earlier (estimates.queued_start).
    last_result_at: float = 0.0
    job_state: JobState | None = None  # the last sent to it: the core's, by identity

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)

    def task_frame(self, tile: Tile, key: Ed25519PrivateKey) -> Sized:
        """The task frame for this worker: the shared bundle, or (for a worker with an
        operand cache) one that refers to the operand blocks it already holds.

        Updates the mirror of the worker's cache exactly as the worker will update the
        cache itself: operands sent inline first, then the ones referred to, each moved
        to the most recently used end; then the least recently used go past the budget.
        """
        if not self.blocks.keeps:
            return tile.bundle
        ids = dict(zip(("a", "b"), tile.blocks, strict=True))
        sizes = dict(zip(("a", "b"), tile.block_bytes(), strict=True))
        refs = frozenset(name for name in ("a", "b") if ids[name] in self.blocks)
        order = [n for n in ("a", "b") if n not in refs] + sorted(refs)  # the task's order
        self.blocks.record((ids[name], sizes[name]) for name in order)
        return tile.task_frame(refs, key)

    def learn(self, tile: Tile, claimed_s: float, held_s: float, up: int, now: float) -> None:
        """Move the estimate toward what this tile showed. Its claimed compute time counts
        no higher than the time the worker held the tile; the rest of the round trip
        measures the links only if the tile did not wait behind another one."""
        if self.estimate is None:
            return
        compute_s = max(0.0, min(claimed_s, held_s))
        transfer_s: float | None = None
        if tile.tile_id in self.sent_idle:
            transfer_s = held_s - compute_s
        self.sent_idle.discard(tile.tile_id)
        down = self.sent_bytes.get(tile.tile_id, len(tile.bundle))  # what went over the link
        share = down / (down + up) if down + up else 0.0
        self.estimate = observe(
            self.estimate,
            TileObservation(
                flops=tile.flops,
                down_bytes=down,
                up_bytes=up,
                down_s=transfer_s * share if transfer_s else None,
                compute_s=compute_s,
                up_s=transfer_s * (1 - share) if transfer_s else None,
            ),
            now,
        )

    @property
    def who(self) -> str:
        """A worker in logs: its chosen name and the key that makes it who it is."""
        return f"{self.name} [{self.fingerprint[:9]}]"

    @property
    def paused(self) -> bool:
        return self.state == WorkerState.PAUSED


@dataclass
class Counters:
    tiles_sent: int = 0
    tiles_verified: int = 0
    compute_s: float = 0.0  # GEMM seconds the workers report for the tiles credited
    reissued: int = 0  # sends of a tile that had been sent before (lost, refused, failed)
    speculated: int = 0  # copies of tiles predicted late, sent to idle workers
    rejected: int = 0  # results that failed verification
    refused: int = 0  # tiles a worker refused (e.g. bad signature)
    duplicates: int = 0
    not_assigned: int = 0  # results for tiles the sender does not hold (replays, forgeries)
    computed_here: int = 0  # tiles no connected worker could take
    flops_computed_here: int = 0  # their FLOPs: offloaded, yet computed at the coordinator
    kept_here: int = 0  # tiles the planner kept at the coordinator (its own share)
    banned: int = 0  # workers banned in this run
    refused_handshakes: int = 0  # connections that failed to authenticate
    directed: int = 0  # joining workers welcomed and sent to another coordinator rank
    bytes_down: int = 0
    bytes_down_uncached: int = 0  # what bytes_down would be without operand caches
    bytes_up: int = 0
    # Bytes (down and up) of bf16/fp16 tiles: as fp32 they would have been twice as many.
    bytes_half: int = 0


@dataclass(frozen=True)
class PoolView:
    """What the training thread may know about the pool: an immutable snapshot the event
    loop replaces, so the other thread never iterates the loop's live dictionaries."""

    workers: int = 0
    active: int = 0
    memory_cap: int | None = None
    # What the cost model knows of each active worker, for the planner (refreshed on
    # joins and leaves, and every tick after tiles moved an estimate).
    estimates: tuple[DeviceEstimate, ...] = ()
