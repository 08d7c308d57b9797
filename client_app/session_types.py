"""The values a ``WorkerSession`` hands its pump: its phase, tiles ready to compute,
the actions after a received message, and its running totals."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from common.messages import Welcome


class Phase(enum.Enum):
    DISCONNECTED = "disconnected"
    CONNECTED = "connected"  # waiting for the coordinator's Challenge
    HELLO_SENT = "hello_sent"  # waiting for Welcome
    READY = "ready"  # welcomed: tasks are accepted
    REFUSED = "refused"  # terminal: the coordinator's key changed
    CLOSED = "closed"  # terminal: the worker said Bye


@dataclass(frozen=True)
class TileJob:
    """A tile whose signature and operands checked out: ready for the compute thread."""

    tile_id: str
    op: str
    a: torch.Tensor  # read-only views of the received frame
    b: torch.Tensor
    flop: int
    received_at: float


@dataclass(frozen=True)
class Actions:
    """What the pump must do after feeding the session one received message."""

    send: tuple[bytes, ...] = ()
    compute: tuple[str, ...] = ()  # tile ids now queued; take them with next_tile()
    cancel: tuple[str, ...] = ()  # tile ids dropped (queued, or results to discard)
    welcome: Welcome | None = None
    first_pin: bool = False  # the welcome's key was pinned just now
    refusal: str = ""  # terminal: stop, do not reconnect (key changed, banned, bad token)
    close: str = ""  # close this connection and reconnect later, for this reason
    # The coordinator's welcome sent this worker to another rank of its job, at this
    # URL (pinned to the same key): close, and join there at once.
    move_to: str = ""


NO_ACTIONS = Actions()


@dataclass
class SessionStats:
    """Totals over the worker's life, across reconnects."""

    tiles_done: int = 0
    tiles_refused: int = 0
    tiles_cancelled: int = 0
    compute_s: float = 0.0
    flop_done: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    credit_tiles: int = 0
    credit_gflop: float = 0.0
    errors_from_coordinator: int = 0
    last_error: str = ""
