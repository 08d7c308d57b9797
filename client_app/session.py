"""The worker's side of the protocol as a state machine with no I/O.

Like websockets' protocol objects: the pump feeds it received bytes and events
("tile finished", "heartbeat due") with the current time, and gets back bytes to send
and work to do. No sockets, threads or clocks live here, so every protocol decision
(pinning, signature checks, cancels, error replies) is unit-tested without a network.

One session lives as long as the worker; ``connect()`` starts each new connection and
``connection_lost()`` forgets that connection's tiles (the coordinator re-issues them).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from client_app.error_replies import error_message, named_in, sent_by_workers
from client_app.held_tiles import Finished, HeldTiles
from client_app.operands import OperandBlocks, check_fits, tile_flop
from client_app.refusals import NEEDS_TOKEN, TERMINAL_ERRORS, PinCheck, check_pins
from client_app.session_types import NO_ACTIONS, Actions, Phase, SessionStats, TileJob
from common.auth import answer_challenge, check_welcome, new_nonce
from common.batches import Voucher, inner_frames, vouchers
from common.errors import ErrorCode, KeyMismatchError, LimitExceeded, ProtocolError
from common.frames import Buffer, FrameParts
from common.job_about import JobAbout
from common.limits import DEFAULT_LIMITS, WireLimits, held_tiles_limit
from common.messages import (
    Ack,
    Batch,
    Bye,
    Cancel,
    Challenge,
    DeviceProfile,
    Error,
    Heartbeat,
    Hello,
    JobState,
    Pause,
    Received,
    Result,
    Resume,
    Task,
    Welcome,
    encode_message,
    message_parts,
    parse_message,
    verify_job_state,
    verify_task_blocks,
)
from common.signing import fingerprint, public_key_from_hex, public_key_hex

log = logging.getLogger(__name__)

_Sent = TypeVar("_Sent", bytes, FrameParts)  # a frame as the pump is handed it

_CONNECTED = (Phase.CONNECTED, Phase.HELLO_SENT, Phase.READY)


class WorkerSession:
    """One worker's protocol state for one coordinator URL, over any number of connections.

    Pure: every method takes the input (bytes, time, a finished tile) and returns what
    to send or do; the caller owns sockets, clocks and threads.
    """

    def __init__(
        self,
        url: str,
        *,
        name: str,
        identity: Ed25519PrivateKey,
        profile: DeviceProfile,
        pin_check: PinCheck,
        window: int = 2,
        token: str = "",
        client: str = "cleave-worker",
        limits: WireLimits = DEFAULT_LIMITS,
        max_held_tiles: int | None = None,
        nonce_source: Callable[[], str] = new_nonce,
        cache_bytes: int = 0,
    ) -> None:
        self.url = url
        self.name = name
        self.identity = identity
        self.identity_key = public_key_hex(identity)
        self.token = token
        self.client = client
        self._nonce_source = nonce_source
        self.profile = profile
        self.window = window
        self.limits = limits
        self._pin_check = pin_check
        # Beyond this the coordinator is misbehaving, and holding more would only grow
        # memory.
        self.max_held_tiles = max_held_tiles or held_tiles_limit(window)
        self.phase = Phase.DISCONNECTED
        self.stats = SessionStats()
        self.paused_reason: str | None = None
        self.worker_id = ""
        self.coordinator_key = ""
        self.fingerprint = ""
        self.about: JobAbout | None = None  # the job, as the coordinator's Welcome says
        # Sent to this URL by another rank of the job: said in the hello, so that this
        # rank does not send the worker on again.
        self.directed = False
        self.rank = 0  # which of the job's coordinator ranks this is, from its welcome
        self.ranks = 0  # 0: a coordinator alone
        self.job_state: JobState | None = None  # its latest signed progress and note
        self.heartbeat_interval_s = 0.0
        self.coordinator_max_frame_bytes = limits.max_frame_bytes
        self._key: Ed25519PublicKey | None = None
        self._challenge: Challenge | None = None
        self._hello: Hello | None = None
        self._tiles = HeldTiles()
        # Operand blocks kept between tasks (least recently used first), so the
        # coordinator can refer to an operand this worker already has instead of
        # sending it again. It mirrors this cache with the same budget and order.
        self.cache_bytes = cache_bytes
        self._blocks = OperandBlocks(cache_bytes)
        self._seq = 0
        self._next_heartbeat = math.inf

    # ---- connection lifecycle -----------------------------------------------------

    def connect(self, now: float) -> None:
        """A new connection is open: forget the last one and wait for its Challenge."""
        if self.phase in (Phase.REFUSED, Phase.CLOSED):
            raise RuntimeError(f"session is {self.phase.value}; it cannot connect again")
        self._tiles.clear()
        # Every connection authenticates anew, and its Welcome is checked against the pin.
        self._key = self._challenge = self._hello = None
        self._blocks.clear()  # the coordinator's mirror of them starts empty too
        self.phase = Phase.CONNECTED
        self._next_heartbeat = math.inf

    def connection_lost(self) -> None:
        """The connection is gone: its tiles are the coordinator's to re-issue."""
        self._tiles.clear()
        self._next_heartbeat = math.inf
        if self.phase in _CONNECTED:
            self.phase = Phase.DISCONNECTED

    def bye(self, reason: str = "") -> bytes | None:
        """Leave for good: the Bye to send (None if not connected). Tiles in flight drop."""
        connected = self.phase in _CONNECTED
        self._tiles.clear()
        if self.phase != Phase.REFUSED:
            self.phase = Phase.CLOSED
        if not connected:
            return None
        return self._out(encode_message(Bye(reason=reason[: self.limits.max_string_chars])))

    # ---- received messages --------------------------------------------------------

    def receive(self, data: Buffer | str, now: float) -> Actions:
        """Handle one received WebSocket message (text messages are protocol errors)."""
        self.stats.bytes_in += len(data)
        return self._receive(data, now, inner=False)

    def _receive(
        self, data: Buffer | str, now: float, inner: bool, voucher: Voucher | None = None
    ) -> Actions:
        if self.phase not in _CONNECTED:
            return NO_ACTIONS  # leaving or refused: nothing more to say
        try:
            received = parse_message(data, self.limits, voucher)  # type: ignore[arg-type]
            if isinstance(received.message, Batch):
                if inner:
                    raise ProtocolError("a batch inside a batch")
                return self._on_batch(inner_frames(received), vouchers(received), now)
        except ProtocolError as exc:
            return self._bad_message(data, exc)
        msg = received.message
        if isinstance(msg, Task):
            return self._on_task(received, msg, now)
        if isinstance(msg, Challenge):
            return self._on_challenge(msg)
        if isinstance(msg, Welcome):
            return self._on_welcome(received, msg, now)
        if isinstance(msg, Cancel):
            return self._on_cancel(msg)
        if isinstance(msg, JobState):
            return self._on_job_state(received, data)
        if isinstance(msg, Ack):
            self.stats.credit_tiles = msg.credit_tiles
            self.stats.credit_gflop = msg.credit_gflop
            return NO_ACTIONS
        if isinstance(msg, Error):
            self.stats.errors_from_coordinator += 1
            self.stats.last_error = f"{msg.code}: {msg.message}"
            tile = f" (tile {msg.tile_id})" if msg.tile_id else ""
            log.warning("coordinator reported %s: %s%s", msg.code, msg.message, tile)
            if msg.code in TERMINAL_ERRORS:
                return self._refuse(f"{TERMINAL_ERRORS[msg.code]}: {msg.message}")
            return NO_ACTIONS
        if isinstance(msg, Bye):
            log.info("coordinator is closing the connection: %s", msg.reason or "no reason given")
            return Actions(close=f"coordinator said bye: {msg.reason or 'no reason given'}")
        # Hello, Result, Heartbeat, Pause, Resume: worker-to-coordinator messages.
        log.warning("coordinator sent an unexpected %r message", msg.TYPE)
        return Actions(send=(self._error(sent_by_workers(msg.TYPE)),))

    def _on_batch(
        self, frames: list[memoryview], vouched: list[Voucher | None], now: float
    ) -> Actions:
        """Each frame of a batch as if it had come alone, in order; what they ask for
        together (nothing after a frame that ends the connection)."""
        send: list[bytes] = []
        compute: list[str] = []
        cancel: list[str] = []
        for frame, voucher in zip(frames, vouched, strict=True):
            actions = self._receive(frame, now, inner=True, voucher=voucher)
            send += actions.send
            compute += actions.compute
            cancel += actions.cancel
            if actions.refusal or actions.close or actions.welcome is not None:
                return replace(
                    actions, send=tuple(send), compute=tuple(compute), cancel=tuple(cancel)
                )
        return Actions(send=tuple(send), compute=tuple(compute), cancel=tuple(cancel))

    def _on_challenge(self, msg: Challenge) -> Actions:
        if self.phase != Phase.CONNECTED:
            again = ProtocolError(
                "challenge after the handshake", code=ErrorCode.UNEXPECTED_MESSAGE
            )
            return Actions(send=(self._error(again),))
        if msg.token_required and not self.token:
            return self._refuse(NEEDS_TOKEN)
        try:
            hello = answer_challenge(
                msg,
                key=self.identity,
                nonce=self._nonce_source(),
                name=self.name,
                profile=self.profile,
                window=self.window,
                client=self.client,
                token=self.token,
                cache_bytes=self.cache_bytes,
                directed=self.directed,
            )
        except ProtocolError as exc:  # a nonce or key that is not what the protocol says
            log.warning("coordinator at %s sent an unusable challenge: %s", self.url, exc.message)
            return Actions(send=(self._error(exc),), close="coordinator sent a bad challenge")
        self._challenge, self._hello = msg, hello
        self.phase = Phase.HELLO_SENT
        return Actions(send=(self._out(encode_message(hello)),))

    def _on_welcome(self, received: Received, msg: Welcome, now: float) -> Actions:
        if self.phase != Phase.HELLO_SENT or self._challenge is None or self._hello is None:
            again = ProtocolError("welcome out of turn", code=ErrorCode.UNEXPECTED_MESSAGE)
            return Actions(send=(self._error(again),))
        try:
            key = public_key_from_hex(msg.coordinator_key)
            check_welcome(msg, received.frame.header, self._challenge, self._hello)
        except ProtocolError as exc:
            # Not the holder of the key it names: a man in the middle, or a broken peer.
            log.warning("coordinator at %s failed to prove its key: %s", self.url, exc.message)
            return Actions(
                send=(self._error(exc),), close=f"coordinator failed to prove its key: {exc}"
            )
        try:
            first_pin = check_pins(self._pin_check, self.url, msg)
        except KeyMismatchError as exc:
            log.error("%s", exc)
            return self._refuse(str(exc), bye="refused: coordinator key changed")
        if msg.serve_at:
            return Actions(
                first_pin=first_pin,
                move_to=msg.serve_at,
                close=f"sent on to {msg.serve_at}, another rank of this job",
            )
        self._key = key
        self.coordinator_key = msg.coordinator_key
        self.fingerprint = fingerprint(msg.coordinator_key)
        self.worker_id = msg.worker_id
        self.about = msg.about
        self.rank, self.ranks = msg.rank, msg.ranks
        self.job_state = None  # this coordinator's word comes after its welcome
        self.heartbeat_interval_s = msg.heartbeat_interval_s
        self.coordinator_max_frame_bytes = msg.max_frame_bytes
        self.phase = Phase.READY
        self._next_heartbeat = now + msg.heartbeat_interval_s
        send: tuple[bytes, ...] = ()
        if self.paused_reason is not None:
            # Paused while disconnected: say so before the coordinator assigns tiles.
            send = (self._out(encode_message(Pause(reason=self.paused_reason))),)
        return Actions(send=send, welcome=msg, first_pin=first_pin)

    def _on_job_state(self, received: Received, data: Buffer | str) -> Actions:
        if self.phase != Phase.READY or self._key is None:
            early = ProtocolError("job state before welcome", code=ErrorCode.UNEXPECTED_MESSAGE)
            return Actions(send=(self._error(early),))
        try:
            # Shown to the volunteer as the coordinator's word: only if it signed it.
            state = verify_job_state(received, self._key)
        except ProtocolError as exc:
            return self._bad_message(data, exc)
        previous = self.job_state.note if self.job_state is not None else ""
        if state.note and state.note != previous:
            log.info("the coordinator says: %s", state.note)  # the headless worker's line
        self.job_state = state
        return NO_ACTIONS

    def _on_task(self, received: Received, msg: Task, now: float) -> Actions:
        tile_id = msg.tile_id
        try:
            if self.phase != Phase.READY or self._key is None:
                raise ProtocolError("task before welcome", code=ErrorCode.UNEXPECTED_MESSAGE)
            if self.paused_reason is not None:
                raise ProtocolError(
                    f"worker is paused: {self.paused_reason}", code=ErrorCode.PAUSED
                )
            if self._tiles.holds(tile_id):
                raise ProtocolError(
                    f"tile {tile_id} is already held", code=ErrorCode.DUPLICATE_TILE
                )
            if self.in_flight >= self.max_held_tiles:
                raise LimitExceeded(
                    f"worker already holds {self.in_flight} tiles "
                    f"(window={self.window}, max_held_tiles={self.max_held_tiles})"
                )
            # The signature is checked before any operand is decoded (verify_task's order).
            (a, b), arrived = verify_task_blocks(received, self._key, self.limits, self._blocks)
            check_fits(a, b, self.profile.mem_cap_bytes, self.coordinator_max_frame_bytes)
            self._blocks.keep(received, arrived)
        except ProtocolError as exc:
            if exc.code == ErrorCode.MISSING_BLOCK:
                # Our cache and the coordinator's mirror of it disagree: both start over
                # (it resends the tile whole).
                self._blocks.clear()
                return Actions(send=(self._error(exc, tile_id),))
            return self._refuse_tile(tile_id, exc)
        self._tiles.add(TileJob(tile_id, msg.op, a, b, tile_flop(a, b), now))
        return Actions(compute=(tile_id,))

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    def _on_cancel(self, msg: Cancel) -> Actions:
        if self._tiles.cancel_queued(msg.tile_id):
            self.stats.tiles_cancelled += 1
            return Actions(cancel=(msg.tile_id,))
        if self._tiles.discard_computing(msg.tile_id):  # counted when it ends
            return Actions(cancel=(msg.tile_id,))
        return NO_ACTIONS  # already sent or never held: the coordinator's race, harmless

    def _refuse_tile(self, tile_id: str, exc: ProtocolError) -> Actions:
        self.stats.tiles_refused += 1
        log.warning("refused tile %s: %s: %s", tile_id, exc.code, exc.message)
        return Actions(send=(self._error(exc, tile_id),))

    def _bad_message(self, data: Buffer | str, exc: ProtocolError) -> Actions:
        # Best effort: name the tile and the type in the reply when the header is readable.
        msg_type, tile_id = named_in(data, self.limits)
        if msg_type == "task":
            return self._refuse_tile(tile_id, exc)
        log.warning("bad message from coordinator: %s: %s", exc.code, exc.message)
        if msg_type == "error":
            return NO_ACTIONS  # never answer an error with an error: no ping-pong
        return Actions(send=(self._error(exc, tile_id),))

    # ---- the compute thread's side ------------------------------------------------

    def next_tile(self, depth: int = 1) -> TileJob | None:
        """The oldest queued tile, now marked as computing; None if none, or if ``depth``
        tiles are computing already (the compute thread's own queue)."""
        return self._tiles.take_next(depth) if self.phase == Phase.READY else None

    def wanted(self, job: TileJob) -> bool:
        """Whether ``job``'s result is still wanted (not cancelled, paused on or gone).
        Read-only: the compute thread asks it before it starts a tile queued there."""
        return self._tiles.wanted(job)

    @property
    def current_tile(self) -> str:
        computing = self._tiles.computing
        return computing.tile_id if computing is not None else ""

    def tile_finished(self, job: TileJob, c: torch.Tensor, compute_s: float) -> bytes | None:
        """The Result to send for ``job``; None if it was cancelled or its connection is gone."""
        result = self.tile_done(job, compute_s)
        return None if result is None else self.result_frame(result, c).join()

    def tile_done(self, job: TileJob, compute_s: float) -> Result | None:
        """``tile_finished`` in two parts: this one books ``job`` as computed (the next
        tile may start at once) and says what to send, ``result_frame`` encodes it."""
        if not self._finish(job):
            return None
        self.stats.tiles_done += 1
        self.stats.compute_s += compute_s
        self.stats.flop_done += job.flop
        return Result(tile_id=job.tile_id, compute_s=round(compute_s, 6))

    def result_frame(self, result: Result, c: torch.Tensor) -> FrameParts:
        """The Result's frame as its parts: ``c`` is sent from where it lies."""
        return self._out(message_parts(result, [("c", c)]))

    def tile_failed(self, job: TileJob, exc: BaseException) -> bytes | None:
        """The Error to send when computing ``job`` raised (out of memory, say)."""
        if not self._finish(job):
            return None
        self.stats.tiles_refused += 1
        log.warning("tile %s failed: %s: %s", job.tile_id, type(exc).__name__, exc)
        error = ProtocolError(f"{type(exc).__name__}: {exc}", code=ErrorCode.COMPUTE_FAILED)
        return self._error(error, job.tile_id)

    def _finish(self, job: TileJob) -> bool:
        finished = self._tiles.finish(job)
        if finished is Finished.DISCARDED:
            self.stats.tiles_cancelled += 1
        return finished is Finished.WANTED

    def holds(self, tile_id: str) -> bool:
        """Whether ``tile_id`` is held for the current connection: queued, or computing
        with its result still wanted."""
        return self._tiles.holds(tile_id)

    @property
    def in_flight(self) -> int:
        """Tiles this worker holds for the current connection (queued + computing)."""
        return len(self._tiles)

    # ---- timers and owner actions --------------------------------------------------

    @property
    def next_heartbeat_at(self) -> float:
        """When ``heartbeat`` will next return a frame (inf before Welcome)."""
        return self._next_heartbeat

    def heartbeat(self, now: float) -> bytes | None:
        """The Heartbeat to send if one is due, else None."""
        if self.phase != Phase.READY or now < self._next_heartbeat:
            return None
        self._seq += 1
        self._next_heartbeat = now + self.heartbeat_interval_s
        if self.paused_reason is not None:
            state, reason = "paused", self.paused_reason
        else:
            state, reason = ("working" if self.in_flight else "idle"), ""
        beat = Heartbeat(seq=self._seq, state=state, in_flight=self.in_flight, reason=reason)
        return self._out(encode_message(beat))

    def pause(self, reason: str) -> Actions:
        """Stop taking tiles; held ones drop (the coordinator moves them elsewhere)."""
        self.paused_reason = reason[: self.limits.max_string_chars]
        dropped = self._tiles.drop_all()
        if self.phase != Phase.READY:
            return Actions(cancel=dropped)
        frame = self._out(encode_message(Pause(reason=self.paused_reason)))
        return Actions(send=(frame,), cancel=dropped)

    def resume(self) -> Actions:
        was_paused = self.paused_reason is not None
        self.paused_reason = None
        if not was_paused or self.phase != Phase.READY:
            return NO_ACTIONS
        return Actions(send=(self._out(encode_message(Resume())),))

    # ---- helpers --------------------------------------------------------------------

    def _refuse(self, why: str, bye: str = "") -> Actions:
        """Stop for good: reconnecting would meet the same refusal."""
        self.phase = Phase.REFUSED
        self._tiles.clear()
        send = (self._out(encode_message(Bye(reason=bye))),) if bye else ()
        return Actions(send=send, refusal=why)

    def _out(self, frame: _Sent) -> _Sent:
        self.stats.bytes_out += len(frame)
        return frame

    def _error(self, exc: ProtocolError, tile_id: str = "") -> bytes:
        return self._out(encode_message(error_message(exc, tile_id, self.limits)))
