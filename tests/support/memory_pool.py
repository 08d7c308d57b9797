"""A coordinator core and worker sessions joined in memory, for tests without sockets.

Both ends are the product's own sans-I/O halves: ``CoordinatorCore`` (with the server's
``Admission`` for the handshake and its ``Checker`` for the Freivalds checks) and the
worker's ``WorkerSession``. Every frame between them is the protocol's real bytes (the
signed challenge, hello and welcome, signed task bundles with cached-block references,
results, heartbeats, errors), carried in order and at once: a pump like the server's,
minus the network. It is a ``TileSink``, so a ``TileOffload`` can run a training step
through it.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client_app.session import WorkerSession
from common.frames import FrameParts
from common.messages import DeviceProfile, Message, Task, parse_message
from common.ops import TileOp
from common.signing import generate_private_key
from common.task_messages import LazyTask
from coordinator.pool.admission import Admission, Admitted, Refusal
from coordinator.pool.core import CoordinatorCore, CoreConfig
from coordinator.pool.effects import Check, Checked, CloseCode, Effects, Send
from coordinator.pool.ledger import Ledger
from coordinator.pool.workers import PoolView
from coordinator.serve.checks import Checker
from coordinator.tiles.tiled_gemm import SignedTile

PROFILE = DeviceProfile("cpu", "test cpu", 1, 1 << 33, 1 << 28, 10.0)


def wire_bytes(send: Send) -> Any:
    """A frame as the worker receives it: a task's parts joined, as WebSocket joins the
    fragments the server sends them in."""
    data = send.data
    return data.join() if isinstance(data, FrameParts | LazyTask) else data


class Answer(enum.Enum):
    HONEST = "honest"  # compute each tile as it arrives and send the product
    WRONG = "wrong"  # the same, with one entry clearly off
    HOLD = "hold"  # keep the tiles, say nothing (``answer_held`` sends them later)


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class MemoryWorker:
    def __init__(
        self,
        pool: MemoryPool,
        name: str,
        *,
        window: int,
        profile: DeviceProfile,
        cache_bytes: int,
        key: Ed25519PrivateKey,
        answer: Answer,
        token: str,
    ) -> None:
        self.pool = pool
        self.name = name
        self.answer = answer
        self.session = WorkerSession(
            "memory://coordinator",
            name=name,
            identity=key,
            profile=profile,
            pin_check=lambda url, key_hex: False,
            window=window,
            token=token,
            cache_bytes=cache_bytes,
        )
        self.worker_id = ""
        self.received: list[Message] = []  # every message the coordinator sent, in order
        self.closed: tuple[CloseCode, str] | None = None  # set when the coordinator closes

    @property
    def tasks(self) -> list[str]:
        return [m.tile_id for m in self.received if isinstance(m, Task)]

    def heartbeat(self) -> None:
        """Send a heartbeat now, due or not."""
        # The session's timer says when one is due; the test says that is now.
        frame = self.session.heartbeat(max(self.pool.clock(), self.session.next_heartbeat_at))
        assert frame is not None, "a heartbeat needs a welcomed session"
        self.pool._from_worker(self, frame)

    @property
    def held(self) -> int:
        """Tiles it holds, unanswered (Answer.HOLD)."""
        return self.session.in_flight

    def answer_held(self, answer: Answer = Answer.HONEST) -> None:
        """Compute and send the tiles held so far, oldest first."""
        while (tile := self.session.next_tile()) is not None:
            self._finish(tile, answer)

    def leave(self, *, bye: bool) -> None:
        """Say bye (the coordinator closes normally), or just drop the connection."""
        if bye:
            frame = self.session.bye("going home")
            assert frame is not None
            self.pool._from_worker(self, frame)
        else:
            self.session.connection_lost()
            self.pool._lost(self)

    def _receive(self, data: bytes) -> None:
        self.received.append(parse_message(data).message)
        actions = self.session.receive(data, self.pool.clock())
        for frame in actions.send:
            self.pool._from_worker(self, frame)
        if actions.compute and self.answer is not Answer.HOLD:
            self.answer_held(self.answer)
        if actions.close or actions.refusal:
            self.session.connection_lost()
            self.pool._lost(self)

    def _finish(self, tile: Any, answer: Answer) -> None:
        c = torch.bmm(tile.a, tile.b) if tile.op == TileOp.BMM else torch.mm(tile.a, tile.b)
        if answer is Answer.WRONG:
            c[(0,) * c.dim()] += 100.0 * (1.0 + float(c.abs().max()))
        frame = self.session.tile_finished(tile, c, compute_s=0.001)
        if frame is not None:
            self.pool._from_worker(self, frame)


class MemoryPool:
    def __init__(
        self,
        tmp_path: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        join_token: str = "",
        **config: Any,
    ) -> None:
        self.ledger = Ledger(tmp_path / "memory-ledger.sqlite")
        self.key = generate_private_key()
        self.config = CoreConfig(**config)
        self.core = CoordinatorCore(key=self.key, ledger=self.ledger, config=self.config)
        self.clock = clock
        self.join_token = join_token
        self.workers: dict[str, MemoryWorker] = {}  # connected, by worker id
        self._admitted: dict[str, MemoryWorker] = {}  # every worker ever welcomed
        self._checker = Checker()
        self._queue: deque[Callable[[], Effects]] = deque()
        self._pumping = False

    # ---- the TileSink ----------------------------------------------------------------

    @property
    def pool(self) -> PoolView:
        return self.core.pool

    def submit(self, tiles: list[SignedTile]) -> None:
        self._pump(lambda: self.core.submit(tiles, self.clock()))

    def kept_here(self, gemm_id: str, tiles: int, finished: bool) -> None:
        self._pump(lambda: self.core.kept_here(gemm_id, tiles, finished, self.clock()))

    # ---- workers and time ----------------------------------------------------------

    def join(
        self,
        name: str,
        *,
        window: int = 2,
        profile: DeviceProfile = PROFILE,
        cache_bytes: int = 0,
        key: Ed25519PrivateKey | None = None,
        answer: Answer = Answer.HONEST,
        token: str | None = None,
    ) -> MemoryWorker:
        """Connect a worker and run its handshake; ``closed`` is set if it was refused."""
        worker = MemoryWorker(
            self,
            name,
            window=window,
            profile=profile,
            cache_bytes=cache_bytes,
            key=key or generate_private_key(),
            answer=answer,
            token=self.join_token if token is None else token,
        )
        admission = Admission(
            self.key,
            self.core,
            "memory-job",
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            max_frame_bytes=self.config.limits.max_frame_bytes,
            join_token=self.join_token,
            limits=self.config.limits,
        )
        session = worker.session
        session.connect(self.clock())
        (hello,) = session.receive(admission.challenge_frame(), self.clock()).send
        verdict = admission.answer(hello)
        if isinstance(verdict, Refusal):
            if verdict.reply is not None:
                worker.received.append(parse_message(verdict.reply).message)
                session.receive(verdict.reply, self.clock())
            worker.closed = (verdict.code, verdict.reason)
            session.connection_lost()
            return worker
        assert isinstance(verdict, Admitted)  # no front door here: nobody is sent on
        worker.received.append(parse_message(verdict.welcome).message)
        assert session.receive(verdict.welcome, self.clock()).welcome is not None
        worker.worker_id = verdict.worker_id
        self.workers[worker.worker_id] = self._admitted[worker.worker_id] = worker
        self._pump(lambda: self.core.admit(worker.worker_id, verdict.hello, self.clock()))
        return worker

    def tick(self) -> None:
        self._pump(lambda: self.core.tick(self.clock()))

    def status(self) -> dict[str, Any]:
        return self.core.status(self.clock())

    def close(self) -> None:
        self.ledger.close()

    # ---- the pump --------------------------------------------------------------------

    def _from_worker(self, worker: MemoryWorker, frame: bytes) -> None:
        if self.workers.get(worker.worker_id) is worker:
            self._pump(lambda: self.core.receive(worker.worker_id, frame, self.clock()))

    def _lost(self, worker: MemoryWorker) -> None:
        if self.workers.pop(worker.worker_id, None) is worker:
            self._pump(lambda: self.core.disconnected(worker.worker_id, self.clock()))

    def _pump(self, step: Callable[[], Effects]) -> None:
        """Run ``step``, then everything its effects cause, in the order they arise."""
        self._queue.append(step)
        if self._pumping:
            return
        self._pumping = True
        try:
            while self._queue:
                self._carry_out(self._queue.popleft()())
        finally:
            self._pumping = False

    def _checked(self, check: Check, outcome: Checked) -> Effects:
        """As the server: the core hears the outcome, then a finished GEMM is released."""
        effects = self.core.checked(check, outcome, self.clock())
        if outcome.finished:
            check.tile.gemm.release()
        return effects

    def _carry_out(self, effects: Effects) -> None:
        closing = {close.worker_id for close in effects.closes}
        for send in effects.sends:
            worker = self.workers.get(send.worker_id)
            # As the server's writer: a connection being closed gets its last words only.
            if worker is not None and not (send.tile_id and send.worker_id in closing):
                worker._receive(wire_bytes(send))
        for close in effects.closes:
            # A worker may have hung up on hearing its last words (a ban): it still
            # learns how the coordinator closed, as over a socket.
            worker = self._admitted.get(close.worker_id)
            if worker is not None and worker.closed is None:
                worker.closed = (close.code, close.reason)
                worker.session.connection_lost()
                self._lost(worker)
        for check in effects.checks:
            outcome = self._checker.run(check)
            self._queue.append(lambda check=check, o=outcome: self._checked(check, o))
        for tile in effects.compute_here:
            finished = self._checker.compute_here(tile)
            self._queue.append(
                lambda tile=tile, f=finished: self.core.delivered(tile, f, self.clock())
            )
