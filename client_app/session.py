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
from collections import OrderedDict
from collections.abc import Callable

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from client_app.session_types import NO_ACTIONS, Actions, Phase, SessionStats, TileJob
from common.auth import answer_challenge, check_welcome, new_nonce
from common.block_cache import BlockCache
from common.errors import ErrorCode, KeyMismatchError, LimitExceeded, ProtocolError
from common.frames import Buffer, decode_frame
from common.job_about import JobAbout
from common.limits import DEFAULT_LIMITS, WireLimits
from common.messages import (
    BLOCK_FIELD,
    Ack,
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
    parse_message,
    verify_job_state,
    verify_task_blocks,
)
from common.signing import fingerprint, public_key_from_hex, public_key_hex

log = logging.getLogger(__name__)

PinCheck = Callable[[str, str], bool]
"""(coordinator URL, key hex) -> True if pinned just now; raises KeyMismatchError."""

# Errors after which reconnecting cannot help: the worker stops and says why.
TERMINAL_ERRORS: dict[str, str] = {
    ErrorCode.BANNED: "this coordinator has banned this worker",
    ErrorCode.BAD_TOKEN: "this coordinator refused the join token",
}

# Room for a result frame's header next to its tensor bytes (a few hundred bytes in
# practice; generous so a long tile id never tips a frame over the coordinator's limit).
RESULT_HEADER_ALLOWANCE = 4096


_CONNECTED = (Phase.CONNECTED, Phase.HELLO_SENT, Phase.READY)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.nbytes


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
        # A coordinator may briefly overshoot the window (a cancelled tile still
        # computing while its replacement arrives); beyond this it is misbehaving and
        # holding more would only grow memory.
        self.max_held_tiles = max_held_tiles or max(4 * window, 8)
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
        self._queue: OrderedDict[str, TileJob] = OrderedDict()
        # Operand blocks kept between tasks (least recently used first), so the
        # coordinator can refer to an operand this worker already has instead of
        # sending it again. It mirrors this cache with the same budget and order.
        self.cache_bytes = cache_bytes
        self._blocks: BlockCache[torch.Tensor] = BlockCache(cache_bytes, _nbytes)
        self._computing: TileJob | None = None
        self._discard_computing = False
        self._seq = 0
        self._next_heartbeat = math.inf

    # ---- connection lifecycle -----------------------------------------------------

    def connect(self, now: float) -> None:
        """A new connection is open: forget the last one and wait for its Challenge."""
        if self.phase in (Phase.REFUSED, Phase.CLOSED):
            raise RuntimeError(f"session is {self.phase.value}; it cannot connect again")
        self._forget_tiles()
        # Every connection authenticates anew, and its Welcome is checked against the pin.
        self._key = self._challenge = self._hello = None
        self._forget_blocks()  # the coordinator's mirror of them starts empty too
        self.phase = Phase.CONNECTED
        self._next_heartbeat = math.inf

    def connection_lost(self) -> None:
        """The connection is gone: its tiles are the coordinator's to re-issue."""
        self._forget_tiles()
        self._next_heartbeat = math.inf
        if self.phase in _CONNECTED:
            self.phase = Phase.DISCONNECTED

    def bye(self, reason: str = "") -> bytes | None:
        """Leave for good: the Bye to send (None if not connected). Tiles in flight drop."""
        connected = self.phase in _CONNECTED
        self._forget_tiles()
        if self.phase != Phase.REFUSED:
            self.phase = Phase.CLOSED
        if not connected:
            return None
        return self._out(encode_message(Bye(reason=reason[: self.limits.max_string_chars])))

    # ---- received messages --------------------------------------------------------

    def receive(self, data: Buffer | str, now: float) -> Actions:
        """Handle one received WebSocket message (text messages are protocol errors)."""
        self.stats.bytes_in += len(data)
        if self.phase not in _CONNECTED:
            return NO_ACTIONS  # leaving or refused: nothing more to say
        try:
            received = parse_message(data, self.limits)  # type: ignore[arg-type]
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
        unexpected = ProtocolError(
            f"{msg.TYPE!r} is sent by workers, not coordinators", code=ErrorCode.UNEXPECTED_MESSAGE
        )
        return Actions(send=(self._error(unexpected),))

    def _on_challenge(self, msg: Challenge) -> Actions:
        if self.phase != Phase.CONNECTED:
            again = ProtocolError(
                "challenge after the handshake", code=ErrorCode.UNEXPECTED_MESSAGE
            )
            return Actions(send=(self._error(again),))
        if msg.token_required and not self.token:
            return self._refuse(
                "this coordinator is a private pool: it needs a join token "
                "(cleave-worker --token, or Settings > Join token in the app)"
            )
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
            first_pin = self._pin_check(self.url, msg.coordinator_key)
            if msg.serve_at:
                # The rank it names speaks for the same key, or this worker refuses it.
                self._pin_check(msg.serve_at, msg.coordinator_key)
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
            if tile_id in self._queue or tile_id == self._live_computing_id():
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
            self._check_fits(a, b)
            self._cache(received, arrived)
        except ProtocolError as exc:
            if exc.code == ErrorCode.MISSING_BLOCK:
                # Our cache and the coordinator's mirror of it disagree: both start over
                # (it resends the tile whole).
                self._forget_blocks()
                return Actions(send=(self._error(exc, tile_id),))
            return self._refuse_tile(tile_id, exc)
        # a: [.., m, k], b: [.., k, n] -> 2 m k n flops per batch entry
        flop = 2 * a.numel() * b.shape[-1]
        self._queue[tile_id] = TileJob(tile_id, msg.op, a, b, flop, now)
        return Actions(compute=(tile_id,))

    def _cache(self, received: Received, arrived: dict[str, torch.Tensor]) -> None:
        """Keep the operands that came under a block id, and mark the ones used from the
        cache as recently used: the same order the coordinator's mirror keeps."""
        if self.cache_bytes <= 0:
            return
        blocks = [
            desc[BLOCK_FIELD]
            for desc in received.frame.header.get("tensors", [])
            if isinstance(desc, dict) and isinstance(desc.get(BLOCK_FIELD), str)
        ]
        self._blocks.record(
            # A copy: a view would keep the whole frame (the other operand too) alive.
            (
                block,
                arrived[block].clone() if block in arrived and block not in self._blocks else None,
            )
            for block in blocks
        )

    def _forget_blocks(self) -> None:
        self._blocks.clear()

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    def _check_fits(self, a: torch.Tensor, b: torch.Tensor) -> None:
        out_bytes = math.prod(a.shape[:-1]) * b.shape[-1] * a.element_size()
        need = a.nbytes + b.nbytes + out_bytes
        cap = self.profile.mem_cap_bytes
        if cap and need > cap:
            raise LimitExceeded(
                f"tile needs {need} bytes (operands + result), over this worker's "
                f"mem_cap_bytes={cap}"
            )
        if out_bytes + RESULT_HEADER_ALLOWANCE > self.coordinator_max_frame_bytes:
            raise LimitExceeded(
                f"result of {out_bytes} bytes would not fit the coordinator's "
                f"max_frame_bytes={self.coordinator_max_frame_bytes}"
            )

    def _on_cancel(self, msg: Cancel) -> Actions:
        if self._queue.pop(msg.tile_id, None) is not None:
            self.stats.tiles_cancelled += 1
            return Actions(cancel=(msg.tile_id,))
        if self._computing is not None and self._computing.tile_id == msg.tile_id:
            # A running GEMM cannot be interrupted; its result is dropped when it ends.
            self._discard_computing = True
            return Actions(cancel=(msg.tile_id,))
        return NO_ACTIONS  # already sent or never held: the coordinator's race, harmless

    def _refuse_tile(self, tile_id: str, exc: ProtocolError) -> Actions:
        self.stats.tiles_refused += 1
        log.warning("refused tile %s: %s: %s", tile_id, exc.code, exc.message)
        return Actions(send=(self._error(exc, tile_id),))

    def _bad_message(self, data: Buffer | str, exc: ProtocolError) -> Actions:
        # Best effort: name the tile and the type in the reply when the header is readable.
        msg_type, tile_id = "", ""
        if not isinstance(data, str):
            try:
                header = decode_frame(data, self.limits).header
            except ProtocolError:
                header = {}
            msg_type = str(header.get("type", ""))
            raw_id = header.get("tile_id")
            if isinstance(raw_id, str) and len(raw_id) <= self.limits.max_string_chars:
                tile_id = raw_id
        if msg_type == "task":
            return self._refuse_tile(tile_id, exc)
        log.warning("bad message from coordinator: %s: %s", exc.code, exc.message)
        if msg_type == "error":
            return NO_ACTIONS  # never answer an error with an error: no ping-pong
        return Actions(send=(self._error(exc, tile_id),))

    # ---- the compute thread's side ------------------------------------------------

    def next_tile(self) -> TileJob | None:
        """The oldest queued tile, now marked as computing; None if none or busy."""
        if self.phase != Phase.READY or self._computing is not None or not self._queue:
            return None
        _, job = self._queue.popitem(last=False)
        self._computing = job
        self._discard_computing = False
        return job

    @property
    def current_tile(self) -> str:
        return self._computing.tile_id if self._computing is not None else ""

    def tile_finished(self, job: TileJob, c: torch.Tensor, compute_s: float) -> bytes | None:
        """The Result to send for ``job``; None if it was cancelled or its connection is gone."""
        result = self.tile_done(job, compute_s)
        return None if result is None else self.result_frame(result, c)

    def tile_done(self, job: TileJob, compute_s: float) -> Result | None:
        """``tile_finished`` in two parts: this one books ``job`` as computed (the next
        tile may start at once) and says what to send, ``result_frame`` encodes it."""
        if not self._finish(job):
            return None
        self.stats.tiles_done += 1
        self.stats.compute_s += compute_s
        self.stats.flop_done += job.flop
        return Result(tile_id=job.tile_id, compute_s=round(compute_s, 6))

    def result_frame(self, result: Result, c: torch.Tensor) -> bytes:
        return self._out(encode_message(result, [("c", c)]))

    def tile_failed(self, job: TileJob, exc: BaseException) -> bytes | None:
        """The Error to send when computing ``job`` raised (out of memory, say)."""
        if not self._finish(job):
            return None
        self.stats.tiles_refused += 1
        log.warning("tile %s failed: %s: %s", job.tile_id, type(exc).__name__, exc)
        error = ProtocolError(f"{type(exc).__name__}: {exc}", code=ErrorCode.COMPUTE_FAILED)
        return self._error(error, job.tile_id)

    def _finish(self, job: TileJob) -> bool:
        if job is not self._computing:
            return False  # from a connection that has since been lost
        self._computing = None
        if self._discard_computing:
            self._discard_computing = False
            self.stats.tiles_cancelled += 1
            return False
        return True

    @property
    def in_flight(self) -> int:
        """Tiles this worker holds for the current connection (queued + computing)."""
        return len(self._queue) + int(bool(self._live_computing_id()))

    def _live_computing_id(self) -> str:
        # A computing tile whose result will be discarded is no longer held: the
        # coordinator may already have handed the same tile back (after a resume).
        if self._computing is None or self._discard_computing:
            return ""
        return self._computing.tile_id

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
        dropped = tuple(self._queue)
        if self._computing is not None:
            self._discard_computing = True
            dropped += (self._computing.tile_id,)
        self._queue.clear()
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
        self._forget_tiles()
        send = (self._out(encode_message(Bye(reason=bye))),) if bye else ()
        return Actions(send=send, refusal=why)

    def _forget_tiles(self) -> None:
        self._queue.clear()
        self._computing = None
        self._discard_computing = False

    def _out(self, frame: bytes) -> bytes:
        self.stats.bytes_out += len(frame)
        return frame

    def _error(self, exc: ProtocolError, tile_id: str = "") -> bytes:
        error = Error(
            code=exc.code[: self.limits.max_string_chars],
            message=exc.message[: self.limits.max_message_chars],
            tile_id=tile_id,
        )
        return self._out(encode_message(error))
