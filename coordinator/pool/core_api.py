"""What the core's message handlers and verdicts may touch of it (``CoreApi``): its maps,
counters and ledger, and the decisions that follow a change. Not its inputs (admit,
receive, checked, tick...), which only the server and the simulator call, so a handler
cannot re-enter the core, and what it may read or do is listed here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from coordinator.pool.core import CoreConfig
    from coordinator.pool.effects import CloseCode, Effects
    from coordinator.pool.ledger import Ledger
    from coordinator.pool.workers import Counters, Worker
    from coordinator.schedule.scheduler import Scheduler


class CoreApi(Protocol):
    @property
    def key(self) -> Ed25519PrivateKey: ...

    @property
    def config(self) -> CoreConfig: ...

    @property
    def ledger(self) -> Ledger: ...

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def counters(self) -> Counters: ...

    @property
    def workers(self) -> dict[str, Worker]: ...

    @property
    def tiles(self) -> dict[str, Any]:
        """Tile id -> Tile, until it is verified or taken over."""
        ...

    @property
    def now(self) -> float:
        """The time of the input being handled."""
        ...

    def wall_time(self) -> float:
        """The time for ledger rows."""
        ...

    def tell_job_state(self, worker: Worker, effects: Effects) -> None:
        """Send the newest JobState, if the worker has not had it."""
        ...

    def active_workers(self) -> int:
        """Connected workers not paused."""
        ...

    def pool_changed(self) -> None:
        """A worker joined, left, paused or resumed: the pool view is made anew."""
        ...

    def dispatch(self, effects: Effects) -> None:
        """Hand free window slots their tiles."""
        ...

    def drop(
        self, worker: Worker, code: CloseCode, reason: str, effects: Effects | None = None
    ) -> Effects:
        """Close one connection with a reason; its tiles move on now."""
        ...

    def rescue_stranded(self, effects: Effects) -> None:
        """Compute here the tiles no connected worker may take."""
        ...

    def cancel(self, worker_id: str, tile_id: str, effects: Effects) -> None:
        """Tell a holder its copy of a tile is no longer wanted."""
        ...
