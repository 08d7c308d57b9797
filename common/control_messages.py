"""Control messages: heartbeats and their acks, the signed job state, cancels, errors,
pauses, resumes and goodbyes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from common.errors import (
    ProtocolError,
)
from common.job_about import MAX_NOTE_CHARS, text_problem
from common.limits import WireLimits
from common.message_fields import integer, number, text, wire_header
from common.signing import SIGNATURE_FIELD, sign_bundle, verify_bundle

if TYPE_CHECKING:
    from common.messages import Received


WORKER_STATES = ("working", "idle", "paused")


@dataclass(frozen=True)
class Heartbeat:
    TYPE: ClassVar[str] = "heartbeat"
    seq: int
    state: str  # one of WORKER_STATES
    in_flight: int
    reason: str = ""  # why paused/idle, shown to operators

    def to_header(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "state": self.state,
            "in_flight": self.in_flight,
            "reason": self.reason,
        }

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Heartbeat:
        state = text(h, "state", "heartbeat", limits)
        if state not in WORKER_STATES:
            raise ProtocolError(f"heartbeat: state {state!r} is not one of {WORKER_STATES}")
        return cls(
            seq=integer(h, "seq", "heartbeat"),
            state=state,
            in_flight=integer(h, "in_flight", "heartbeat", hi=1 << 20),
            reason=text(h, "reason", "heartbeat", limits) if "reason" in h else "",
        )


@dataclass(frozen=True)
class Ack:
    TYPE: ClassVar[str] = "ack"
    seq: int
    credit_tiles: int  # verified tiles the ledger holds for this worker
    credit_gflop: float

    def to_header(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "credit_tiles": self.credit_tiles,
            "credit_gflop": self.credit_gflop,
        }

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Ack:
        return cls(
            seq=integer(h, "seq", "ack"),
            credit_tiles=integer(h, "credit_tiles", "ack"),
            credit_gflop=number(h, "credit_gflop", "ack"),
        )


@dataclass(frozen=True)
class JobState:
    """How far the training has come, and why no tiles come when none do.

    Signed like a task (``sign_job_state``): it is shown to the volunteer as the
    coordinator's word, so a party on the path must not be able to put words in it.
    """

    TYPE: ClassVar[str] = "job_state"
    step: int  # steps completed
    steps: int  # steps the run is to train; 0: open-ended
    note: str = ""  # why no tiles come, for people; "" when there is nothing to say
    sig: str = ""

    def to_header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"step": self.step, "steps": self.steps, "note": self.note}
        if self.sig:
            header[SIGNATURE_FIELD] = self.sig
        return header

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> JobState:
        note = text(h, "note", "job_state", limits, max_chars=MAX_NOTE_CHARS)
        problem = text_problem(note, max_chars=MAX_NOTE_CHARS)
        if problem:
            raise ProtocolError(f'job_state: field "note" {problem}')
        return cls(
            step=integer(h, "step", "job_state"),
            steps=integer(h, "steps", "job_state"),
            note=note,
            sig=text(h, SIGNATURE_FIELD, "job_state", limits) if SIGNATURE_FIELD in h else "",
        )


def sign_job_state(key: Ed25519PrivateKey, state: JobState) -> JobState:
    """``state`` with its signature: made once per change, sent to every worker."""
    unsigned = JobState(state.step, state.steps, state.note)
    return JobState(state.step, state.steps, state.note, sign_bundle(key, wire_header(unsigned)))


def verify_job_state(received: Received, key: Ed25519PublicKey) -> JobState:
    """The received JobState, if ``key`` signed it; SignatureError otherwise."""
    verify_bundle(key, received.frame.header)
    assert isinstance(received.message, JobState)
    return received.message


@dataclass(frozen=True)
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    tile_id: str

    def to_header(self) -> dict[str, Any]:
        return {"tile_id": self.tile_id}

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Cancel:
        return cls(tile_id=text(h, "tile_id", "cancel", limits))


@dataclass(frozen=True)
class Error:
    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    tile_id: str = ""

    def to_header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.tile_id:
            header["tile_id"] = self.tile_id
        return header

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Error:
        return cls(
            code=text(h, "code", "error", limits),
            message=text(h, "message", "error", limits, max_chars=limits.max_message_chars),
            tile_id=text(h, "tile_id", "error", limits) if "tile_id" in h else "",
        )


@dataclass(frozen=True)
class Pause:
    """The worker stops taking tiles (owner's limits); its in-flight tiles move elsewhere."""

    TYPE: ClassVar[str] = "pause"
    reason: str

    def to_header(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Pause:
        return cls(reason=text(h, "reason", "pause", limits))


@dataclass(frozen=True)
class Resume:
    TYPE: ClassVar[str] = "resume"

    def to_header(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Resume:
        return cls()


@dataclass(frozen=True)
class Bye:
    TYPE: ClassVar[str] = "bye"
    reason: str = ""

    def to_header(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Bye:
        return cls(reason=text(h, "reason", "bye", limits) if "reason" in h else "")
