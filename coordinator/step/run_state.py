"""The training run's states, as ``/api/status``, ``/metrics``, workers and the other
coordinator ranks see them."""

from __future__ import annotations

import enum


class RunState(str, enum.Enum):
    """The training run's state; the values are what ``/api/status``, ``/metrics`` and
    the other ranks read."""

    STARTING = "starting"
    WAITING = "waiting for workers"
    TRAINING = "training"
    STOPPING = "stopping"
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value

    @property
    def closed(self) -> bool:
        """A run in this state takes no more workers (a starting one already listens)."""
        return self in (RunState.STOPPING, RunState.DONE, RunState.STOPPED, RunState.FAILED)
