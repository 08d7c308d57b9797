"""What ``CoordinatorCore`` answers each input with: one ``Effects`` value for its pump
(the server, or the simulator) to carry out, in order."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch

from common.messages import Message, encode_message


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
    frame: Any = None  # a task frame: bytes on the server, a sized stand-in in the simulator
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
    """Check a returned tile (Freivalds, off the event loop), then call ``checked``."""

    worker_id: str
    tile_id: str
    job: Any  # the Tile
    c: torch.Tensor | None  # None: the result did not decode, so it fails
    up_bytes: int
    compute_s: float


@dataclass(frozen=True)
class Deliver:
    """Place a verified tile into its GEMM; then call ``delivered``."""

    job: Any
    c: Any  # the verified product (the simulator has none)


@dataclass
class Effects:
    sends: list[Send] = field(default_factory=list)
    closes: list[Close] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    delivers: list[Deliver] = field(default_factory=list)
    # Tiles no connected worker may take: compute them here, then call ``delivered``.
    compute_here: list[Any] = field(default_factory=list)
    workers_changed: bool = False  # joins, leaves, pauses: wake whoever waits for workers

    def send(self, worker_id: str, message: Message) -> None:
        self.sends.append(Send(worker_id, message=message))

    def close(self, worker_id: str, code: CloseCode, reason: str) -> None:
        self.closes.append(Close(worker_id, code, reason))
