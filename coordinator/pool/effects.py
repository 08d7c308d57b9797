"""What ``CoordinatorCore`` answers each input with: one ``Effects`` value for its pump
(the server, or the simulator) to carry out, in order."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from common.errors import ProtocolError
from common.messages import Message, Received, encode_message
from coordinator.tiles.verify import CheckResult


class CloseCode(IntEnum):
    NORMAL = 1000
    POLICY = 1008  # RFC 6455: policy violation (malformed or forbidden messages)
    TRY_LATER = 1013  # RFC 6455: try again later (too many handshakes at once)
    TIMEOUT = 4000  # application code: missed heartbeats


@dataclass(frozen=True)
class Send:
    """A frame for one worker: a task (``frame``, already signed) or a control message
    (``message``, encoded when it is written, so the simulator never encodes one)."""

    worker_id: str
    frame: Any = None  # a task frame: FrameParts on the server, a sized stand-in in the simulator
    tile_id: str = ""  # set on task frames: a closing connection may skip them
    message: Message | None = None

    @property
    def data(self) -> Any:
        return self.frame if self.message is None else encode_message(self.message)


@dataclass(frozen=True)
class Close:
    """Close this connection after the frames already emitted for it (its last words)."""

    worker_id: str
    code: CloseCode
    reason: str


@dataclass(frozen=True)
class Check:
    """Decode a returned tile, check it (Freivalds) and, if it passes, place it into its
    GEMM (on the check thread; small tiles on the event loop), then call ``checked``
    with what came of it."""

    worker_id: str
    tile_id: str
    tile: Any  # the Tile
    result: Received | None  # the result's frame, decoded by the checker (None: the simulator's)
    up_bytes: int
    compute_s: float


@dataclass(frozen=True)
class Checked:
    """What came of a ``Check``."""

    result: CheckResult | None  # the check's; None: the result did not decode, so it fails
    finished: bool = False  # placing the tile completed its GEMM
    error: ProtocolError | None = None  # why it did not decode
    # Its tile was placed already, from another copy's result: this one was not checked
    # (its operands may have changed since: the step goes on once its GEMMs are done).
    late: bool = False


@dataclass
class Effects:
    sends: list[Send] = field(default_factory=list)
    closes: list[Close] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    # Tiles no connected worker may take: compute them here, then call ``delivered``.
    compute_here: list[Any] = field(default_factory=list)
    workers_changed: bool = False  # joins, leaves, pauses: wake whoever waits for workers

    def send(self, worker_id: str, message: Message) -> None:
        self.sends.append(Send(worker_id, message=message))

    def close(self, worker_id: str, code: CloseCode, reason: str) -> None:
        self.closes.append(Close(worker_id, code, reason))
