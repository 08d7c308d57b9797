"""Protocol messages: typed views of frame headers, validated on the way in.

Each message is a frozen dataclass with ``to_header()`` and ``from_header()``; tensors
(task operands, result tiles) travel in the frame payload and are described by the
header's ``"tensors"`` list (see ``common.tensors``). ``parse_message`` is the single
entry point for received bytes and raises only ``ProtocolError`` subclasses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from common import PROTOCOL_VERSION
from common.errors import (
    ErrorCode,
    LimitExceeded,
    ProtocolError,
    SignatureError,
    TensorCodecError,
)
from common.frames import Frame, FrameParts, decode_frame, encode_frame, frame_head
from common.job_about import MAX_NOTE_CHARS, JobAbout, text_problem
from common.limits import DEFAULT_LIMITS, WireLimits
from common.ops import TILE_OPS, TileOp
from common.signing import SIGNATURE_FIELD, sign_bundle, verify_bundle
from common.tensors import (
    Block,
    content_id,
    decode_tensors,
    dtype_name,
    encode_block,
    encode_tensors,
)
from common.unfold import UNFOLD_FIELD, Unfold

BLOCK_FIELD = "block"  # a task operand's content id: signed, and its cache key
REF_FIELD = "ref"  # true: the operand is not in the payload; the worker has that block
WORKER_STATES = ("working", "idle", "paused")


# ---- field readers: each names the message and field in its error ------------------


def _req(h: dict[str, Any], key: str, kind: type | tuple[type, ...], msg: str) -> Any:
    value = h.get(key)
    numeric = kind in (int, float, (int, float))
    if not isinstance(value, kind) or (isinstance(value, bool) and numeric):
        raise ProtocolError(f'{msg}: field "{key}" is missing or not {_kind_name(kind)}')
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def _str(h: dict[str, Any], key: str, msg: str, limits: WireLimits, *, max_chars: int = 0) -> str:
    value = _req(h, key, str, msg)
    if len(value) > (max_chars or limits.max_string_chars):
        raise ProtocolError(f'{msg}: field "{key}" is too long')
    return str(value)


def _int(h: dict[str, Any], key: str, msg: str, *, lo: int = 0, hi: int = 1 << 62) -> int:
    value = _req(h, key, int, msg)
    if not lo <= value <= hi:
        raise ProtocolError(f'{msg}: field "{key}"={value} outside [{lo}, {hi}]')
    return int(value)


def _num(h: dict[str, Any], key: str, msg: str, *, lo: float = 0.0, hi: float = 1e18) -> float:
    value = _req(h, key, (int, float), msg)
    if not lo <= value <= hi:
        raise ProtocolError(f'{msg}: field "{key}"={value} outside [{lo}, {hi}]')
    return float(value)


def _obj(h: dict[str, Any], key: str, msg: str) -> dict[str, Any]:
    value = h.get(key, {})
    if not isinstance(value, dict):
        raise ProtocolError(f'{msg}: field "{key}" must be an object')
    return value


# ---- messages ---------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceProfile:
    device: str = "cpu"  # "cpu" or "cuda"
    device_name: str = ""
    threads: int = 1
    ram_bytes: int = 0
    mem_cap_bytes: int = 0  # largest tile (operands + output) this worker accepts
    gflops: float = 0.0  # measured at start-up

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "device_name": self.device_name,
            "threads": self.threads,
            "ram_bytes": self.ram_bytes,
            "mem_cap_bytes": self.mem_cap_bytes,
            "gflops": self.gflops,
        }

    @classmethod
    def from_json(cls, h: dict[str, Any], limits: WireLimits) -> DeviceProfile:
        m = "hello.profile"
        device = _str(h, "device", m, limits)
        if device not in ("cpu", "cuda"):
            raise ProtocolError(f'{m}: device must be "cpu" or "cuda", not {device!r}')
        return cls(
            device=device,
            device_name=_str(h, "device_name", m, limits),
            threads=_int(h, "threads", m, lo=1, hi=4096),
            ram_bytes=_int(h, "ram_bytes", m),
            mem_cap_bytes=_int(h, "mem_cap_bytes", m),
            gflops=_num(h, "gflops", m),
        )


@dataclass(frozen=True)
class Challenge:
    """The coordinator's first message on every connection (see ``common.auth``)."""

    TYPE: ClassVar[str] = "challenge"
    nonce: str  # fresh per connection: the hello's signature covers it
    coordinator_key: str  # hex of the raw Ed25519 public key
    token_required: bool = False  # a private pool: the hello must prove the join token

    def to_header(self) -> dict[str, Any]:
        return {
            "nonce": self.nonce,
            "coordinator_key": self.coordinator_key,
            "token_required": self.token_required,
        }

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Challenge:
        return cls(
            nonce=_str(h, "nonce", "challenge", limits),
            coordinator_key=_str(h, "coordinator_key", "challenge", limits),
            token_required=_req(h, "token_required", bool, "challenge"),
        )


@dataclass(frozen=True)
class Hello:
    """The worker's answer to a challenge: who it is, what it has, and proof of its key."""

    TYPE: ClassVar[str] = "hello"
    name: str  # display name only: identity, credit and reputation follow worker_key
    profile: DeviceProfile
    window: int  # tiles the worker wants in flight (prefetch)
    client: str = "cleave-worker"
    worker_key: str = ""  # hex of the worker's raw Ed25519 public key
    nonce: str = ""  # the worker's own challenge: the welcome's signature covers it
    token_proof: str = ""  # HMAC of the join token (private pools), never the token
    cache_bytes: int = 0  # operand blocks it keeps between tasks; 0: send every operand
    # Sent here by another rank's welcome: this rank does not send it on again.
    directed: bool = False
    sig: str = ""  # by worker_key, over the coordinator's nonce and key and this header

    def to_header(self) -> dict[str, Any]:
        header = {
            "name": self.name,
            "profile": self.profile.to_json(),
            "window": self.window,
            "client": self.client,
            "worker_key": self.worker_key,
            "nonce": self.nonce,
            "token_proof": self.token_proof,
            "cache_bytes": self.cache_bytes,
        }
        if self.directed:
            header["directed"] = True
        if self.sig:
            header[SIGNATURE_FIELD] = self.sig
        return header

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Hello:
        return cls(
            name=_str(h, "name", "hello", limits),
            profile=DeviceProfile.from_json(_obj(h, "profile", "hello"), limits),
            window=_int(h, "window", "hello", lo=1, hi=64),
            client=_str(h, "client", "hello", limits),
            worker_key=_str(h, "worker_key", "hello", limits),
            nonce=_str(h, "nonce", "hello", limits),
            token_proof=_str(h, "token_proof", "hello", limits),
            cache_bytes=_int(h, "cache_bytes", "hello") if "cache_bytes" in h else 0,
            directed=_req(h, "directed", bool, "hello") if "directed" in h else False,
            sig=_str(h, SIGNATURE_FIELD, "hello", limits) if SIGNATURE_FIELD in h else "",
        )


@dataclass(frozen=True)
class Welcome:
    TYPE: ClassVar[str] = "welcome"
    worker_id: str  # this connection's id at the coordinator
    coordinator_key: str  # hex of the raw Ed25519 public key
    heartbeat_interval_s: float
    max_frame_bytes: int
    job: str
    # What the job is, in the operator's words: signed with the rest of the welcome.
    about: JobAbout | None = None
    # One of several coordinator ranks of the job: which one (0-based) of how many.
    rank: int = 0
    ranks: int = 0  # 0: a coordinator alone
    # Serve the rank at this ws(s):// URL instead (it speaks for the same key): the
    # front door sends a joining worker where the job needs it. "": stay here.
    serve_at: str = ""
    sig: str = ""  # by coordinator_key, over the hello's nonce and worker key

    def to_header(self) -> dict[str, Any]:
        header: dict[str, Any] = {
            "worker_id": self.worker_id,
            "coordinator_key": self.coordinator_key,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "max_frame_bytes": self.max_frame_bytes,
            "job": self.job,
        }
        if self.about is not None:
            header["about"] = self.about.to_header()
        if self.ranks:
            header["rank"], header["ranks"] = self.rank, self.ranks
        if self.serve_at:
            header["serve_at"] = self.serve_at
        if self.sig:
            header[SIGNATURE_FIELD] = self.sig
        return header

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Welcome:
        ranks = _int(h, "ranks", "welcome", hi=1 << 16) if "ranks" in h else 0
        rank = _int(h, "rank", "welcome", hi=max(0, ranks - 1)) if ranks else 0
        serve_at = _serve_at(h, limits) if "serve_at" in h else ""
        return cls(
            worker_id=_str(h, "worker_id", "welcome", limits),
            coordinator_key=_str(h, "coordinator_key", "welcome", limits),
            heartbeat_interval_s=_num(h, "heartbeat_interval_s", "welcome", lo=0.01, hi=3600),
            max_frame_bytes=_int(h, "max_frame_bytes", "welcome", lo=1),
            job=_str(h, "job", "welcome", limits),
            about=_about(h) if "about" in h else None,
            rank=rank,
            ranks=ranks,
            serve_at=serve_at,
            sig=_str(h, SIGNATURE_FIELD, "welcome", limits) if SIGNATURE_FIELD in h else "",
        )


MAX_URL_CHARS = 512


def _serve_at(h: dict[str, Any], limits: WireLimits) -> str:
    url = _str(h, "serve_at", "welcome", limits, max_chars=MAX_URL_CHARS)
    if not url.startswith(("ws://", "wss://")) or any(c.isspace() for c in url):
        raise ProtocolError('welcome: field "serve_at" must be a ws:// or wss:// URL')
    problem = text_problem(url, max_chars=MAX_URL_CHARS)
    if problem:
        raise ProtocolError(f'welcome: field "serve_at" {problem}')
    return url


def _about(h: dict[str, Any]) -> JobAbout:
    try:
        return JobAbout.from_header(h["about"])
    except ValueError as exc:
        raise ProtocolError(f"welcome: {exc}") from None


@dataclass(frozen=True)
class Task:
    """A signed tile: ``c = a @ b`` (op "mm": 2-D, op "bmm": 3-D batched). With
    ``unfold`` (mm only), one operand is an image block standing for its patch matrix
    (``common.unfold``): a convolution's GEMM."""

    TYPE: ClassVar[str] = "task"
    tile_id: str
    op: str
    tensors: list[dict[str, Any]]
    sig: str = ""
    unfold: Unfold | None = None

    def to_header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"tile_id": self.tile_id, "op": self.op, "tensors": self.tensors}
        if self.unfold is not None:
            header[UNFOLD_FIELD] = self.unfold.to_header()
        if self.sig:
            header["sig"] = self.sig
        return header

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Task:
        op = _str(h, "op", "task", limits)
        if op not in TILE_OPS:
            raise ProtocolError(f"task: op {op!r} is not one of {TILE_OPS}", code=ErrorCode.BAD_OP)
        tensors = h.get("tensors")
        if not isinstance(tensors, list):
            raise ProtocolError('task: field "tensors" must be a list')
        sig = h.get("sig", "")
        if not isinstance(sig, str):
            raise ProtocolError('task: field "sig" must be a string')
        unfold = Unfold.from_header(h[UNFOLD_FIELD]) if UNFOLD_FIELD in h else None
        if unfold is not None and op != TileOp.MM:
            raise ProtocolError(
                f'task: "{UNFOLD_FIELD}" needs op "mm", not {op!r}', code=ErrorCode.BAD_OP
            )
        return cls(
            tile_id=_str(h, "tile_id", "task", limits),
            op=op,
            tensors=tensors,
            sig=sig,
            unfold=unfold,
        )


def check_operands(
    op: str,
    tensors: dict[str, torch.Tensor],
    limits: WireLimits = DEFAULT_LIMITS,
    unfold: Unfold | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of a task, after checking they make a valid GEMM for ``op``; with
    ``unfold``, the image operand expanded into its patch matrix."""
    if op not in TILE_OPS:
        raise ProtocolError(f"task: op {op!r} is not one of {TILE_OPS}", code=ErrorCode.BAD_OP)
    if set(tensors) != {"a", "b"}:
        raise TensorCodecError(f"task needs exactly tensors 'a' and 'b', got {sorted(tensors)}")
    a, b = tensors["a"], tensors["b"]
    if unfold is not None:
        if op != TileOp.MM:
            raise ProtocolError(
                f"task: an unfolded operand needs op mm, not {op!r}", code=ErrorCode.BAD_OP
            )
        image, other = (a, b) if unfold.operand == "a" else (b, a)
        unfold.check_image(image, limits)
        if other.dim() != 2 or image.dtype != other.dtype:
            raise TensorCodecError(
                f"an unfolded mm needs a 2-D {image.dtype} other operand, got "
                f"{other.dtype} {list(other.shape)}"
            )
        a, b = unfold.matrices(a, b)
    ndim = 2 if op == TileOp.MM else 3
    if a.dim() != ndim or b.dim() != ndim:
        raise TensorCodecError(
            f"{op} needs {ndim}-D operands, got {list(a.shape)}, {list(b.shape)}"
        )
    if a.dtype != b.dtype:
        raise TensorCodecError(f"operand dtypes differ: {a.dtype} vs {b.dtype}")
    if a.shape[-1] != b.shape[-2] or (op == TileOp.BMM and a.shape[0] != b.shape[0]):
        raise TensorCodecError(f"{op} shapes do not match: {list(a.shape)} @ {list(b.shape)}")
    # Small operands can describe a huge product ([2^24, 1] @ [1, 2^24]); the output must
    # fit the same element limit as any tensor, or the result could never be sent back.
    out_elements = math.prod(a.shape[:-1]) * b.shape[-1]
    if out_elements > limits.max_tensor_elements:
        raise LimitExceeded(
            f"{op} output of {out_elements} elements exceeds "
            f"max_tensor_elements={limits.max_tensor_elements}"
        )
    return a, b


@dataclass(frozen=True)
class Result:
    TYPE: ClassVar[str] = "result"
    tile_id: str
    compute_s: float
    tensors: list[dict[str, Any]] = field(default_factory=list)

    def to_header(self) -> dict[str, Any]:
        return {"tile_id": self.tile_id, "compute_s": self.compute_s, "tensors": self.tensors}

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Result:
        tensors = h.get("tensors")
        if not isinstance(tensors, list):
            raise ProtocolError('result: field "tensors" must be a list')
        return cls(
            tile_id=_str(h, "tile_id", "result", limits),
            compute_s=_num(h, "compute_s", "result", hi=1e6),
            tensors=tensors,
        )


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
        state = _str(h, "state", "heartbeat", limits)
        if state not in WORKER_STATES:
            raise ProtocolError(f"heartbeat: state {state!r} is not one of {WORKER_STATES}")
        return cls(
            seq=_int(h, "seq", "heartbeat"),
            state=state,
            in_flight=_int(h, "in_flight", "heartbeat", hi=1 << 20),
            reason=_str(h, "reason", "heartbeat", limits) if "reason" in h else "",
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
            seq=_int(h, "seq", "ack"),
            credit_tiles=_int(h, "credit_tiles", "ack"),
            credit_gflop=_num(h, "credit_gflop", "ack"),
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
        note = _str(h, "note", "job_state", limits, max_chars=MAX_NOTE_CHARS)
        problem = text_problem(note, max_chars=MAX_NOTE_CHARS)
        if problem:
            raise ProtocolError(f'job_state: field "note" {problem}')
        return cls(
            step=_int(h, "step", "job_state"),
            steps=_int(h, "steps", "job_state"),
            note=note,
            sig=_str(h, SIGNATURE_FIELD, "job_state", limits) if SIGNATURE_FIELD in h else "",
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
        return cls(tile_id=_str(h, "tile_id", "cancel", limits))


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
            code=_str(h, "code", "error", limits),
            message=_str(h, "message", "error", limits, max_chars=limits.max_message_chars),
            tile_id=_str(h, "tile_id", "error", limits) if "tile_id" in h else "",
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
        return cls(reason=_str(h, "reason", "pause", limits))


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
        return cls(reason=_str(h, "reason", "bye", limits) if "reason" in h else "")


Message = (
    Challenge
    | Hello
    | Welcome
    | Task
    | Result
    | Heartbeat
    | Ack
    | JobState
    | Cancel
    | Error
    | Pause
    | Resume
    | Bye
)
MESSAGE_TYPES: dict[str, Any] = {
    cls.TYPE: cls
    for cls in (
        Challenge,
        Hello,
        Welcome,
        Task,
        Result,
        Heartbeat,
        Ack,
        JobState,
        Cancel,
        Error,
        Pause,
        Resume,
        Bye,
    )
}


def wire_header(msg: Message) -> dict[str, Any]:
    """The header ``msg`` travels with (before any tensors): what handshakes sign."""
    return {"type": msg.TYPE, "v": PROTOCOL_VERSION, **msg.to_header()}


def encode_message(msg: Message, tensors: list[tuple[str, torch.Tensor]] | None = None) -> bytes:
    """Frame a message; tensors (if any) go into the payload and the header's "tensors"."""
    header = wire_header(msg)
    parts: list[memoryview | bytes] = []
    if tensors:
        header["tensors"], parts = encode_tensors(tensors)
    return encode_frame(header, parts)


def task_frame(
    tile_id: str,
    op: str,
    a: Block,
    b: Block,
    key: Ed25519PrivateKey,
    *,
    refs: frozenset[str] = frozenset(),
    unfold: Unfold | None = None,
) -> FrameParts:
    """A signed task bundle for ``a @ b`` (with ``unfold``: one of them an image block
    standing for its patch matrix), made of the blocks themselves: nothing is copied
    or hashed here, only the header is built and signed. The signature covers each
    operand's content id (``Block.id``), which binds the operand's bytes.

    Operand cache: an operand whose name is in ``refs`` is not sent at all, only
    referred to by its id (the worker must hold it from an earlier task).
    """
    if op not in TILE_OPS:
        raise ValueError(f"op {op!r} is not one of {TILE_OPS}")
    descriptors: list[dict[str, Any]] = []
    parts: list[memoryview] = []
    offset = end = 0
    for name, block in (("a", a), ("b", b)):
        t = block.tensor
        desc: dict[str, Any] = {"name": name, "dtype": dtype_name(t.dtype)}
        desc["shape"], desc[BLOCK_FIELD] = list(t.shape), block.id
        if name in refs:
            desc[REF_FIELD] = True
        else:
            # Laid out as the codec lays out tensors: each at the next aligned offset,
            # the padding before it being the previous block's own zero padding.
            desc["offset"], desc["nbytes"] = offset, block.nbytes
            parts.append(block.padded)
            end = offset + block.nbytes
            offset += len(block.padded)
        descriptors.append(desc)
    if parts:  # the payload ends where its last operand does: no padding after it
        parts[-1] = parts[-1][: len(parts[-1]) - (offset - end)]
    header: dict[str, Any] = {
        "type": Task.TYPE,
        "v": PROTOCOL_VERSION,
        "tile_id": tile_id,
        "op": op,
        "tensors": descriptors,
        **({UNFOLD_FIELD: unfold.to_header()} if unfold is not None else {}),
    }
    header[SIGNATURE_FIELD] = sign_bundle(key, header)
    return FrameParts([frame_head(header), *parts])


def encode_task(
    tile_id: str,
    op: str,
    a: torch.Tensor,
    b: torch.Tensor,
    key: Ed25519PrivateKey,
    *,
    ids: tuple[str | None, str | None] = (None, None),
    refs: frozenset[str] = frozenset(),
    unfold: Unfold | None = None,
) -> bytes:
    """``task_frame`` for two tensors (any strides), as one buffer: ``ids`` gives the
    content ids already known (the others are computed); an operand in ``refs`` needs
    its id."""

    def block(name: str, t: torch.Tensor, block_id: str | None) -> Block:
        if name not in refs:
            return encode_block(t, block_id)
        if block_id is None:
            raise ValueError("refs need content ids")
        return Block(t, memoryview(b""), block_id)  # not sent: its dtype, shape and id

    a_block, b_block = block("a", a, ids[0]), block("b", b, ids[1])
    return task_frame(tile_id, op, a_block, b_block, key, refs=refs, unfold=unfold).join()


def verify_task(
    received: Received,
    key: Ed25519PublicKey,
    limits: WireLimits = DEFAULT_LIMITS,
    blocks: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a task's signature, then decode and check its operands under ``limits``.

    The signature is checked first so that nothing unsigned is even decoded. Operands
    sent by reference are taken from ``blocks`` (the worker's operand cache); a missing
    one raises ``ProtocolError`` with code ``missing_block`` so the coordinator resends.
    """
    operands, _ = verify_task_blocks(received, key, limits, blocks)
    return operands


def verify_task_blocks(
    received: Received,
    key: Ed25519PublicKey,
    limits: WireLimits = DEFAULT_LIMITS,
    blocks: Mapping[str, torch.Tensor] | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]:
    """``verify_task``, plus the operands that arrived inline under a block id (for the
    worker to cache): ``((a, b), {block_id: tensor})``."""
    if not isinstance(received.message, Task):
        raise ProtocolError(f"expected a task, got a {received.message.TYPE!r} message")
    verify_bundle(key, received.frame.header)
    descriptors = received.frame.header.get("tensors", [])
    if not isinstance(descriptors, list):
        raise TensorCodecError('"tensors" must be a list of descriptors')
    inline = [d for d in descriptors if not (isinstance(d, dict) and d.get(REF_FIELD) is True)]
    tensors = decode_tensors(inline, received.frame.payload, limits)
    cacheable: dict[str, torch.Tensor] = {}
    for desc in inline:
        # The signature covers the header; this binds each operand's bytes to it.
        block = _block_id(desc.get(BLOCK_FIELD), limits)
        if content_id(tensors[desc["name"]]) != block:
            raise SignatureError(
                f"operand {desc['name']!r} does not match the content id its signature "
                "covers (tampered in transit)"
            )
        cacheable[block] = tensors[desc["name"]]
    _only_padding_between(inline, received.frame.payload)
    for desc in descriptors:
        if isinstance(desc, dict) and desc.get(REF_FIELD) is True:
            name, tensor = _resolve_ref(desc, blocks or {}, limits)
            if name in tensors:
                raise TensorCodecError(f"tensor {name!r} is both sent and referred to")
            tensors[name] = tensor
    task = received.message
    return check_operands(task.op, tensors, limits, task.unfold), cacheable


def _only_padding_between(inline: list[dict[str, Any]], payload: memoryview) -> None:
    """Every payload byte outside the operands is zero alignment padding between them:
    the content ids bind the operands, so this leaves no byte of a task unsigned."""
    at = 0
    for start, end in sorted((d["offset"], d["offset"] + d["nbytes"]) for d in inline):
        if start > at and payload[at:start] != bytes(start - at):
            raise SignatureError(
                "task payload has unsigned bytes between its operands (tampered in transit)"
            )
        at = max(at, end)
    if at != len(payload):
        raise SignatureError(
            "task payload has unsigned bytes after its operands (tampered in transit)"
        )


def _block_id(value: Any, limits: WireLimits) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= limits.max_string_chars:
        raise TensorCodecError(f'tensor field "{BLOCK_FIELD}" must be a short string')
    return value


def _resolve_ref(
    desc: dict[str, Any], blocks: Mapping[str, torch.Tensor], limits: WireLimits
) -> tuple[str, torch.Tensor]:
    """The cached operand a reference descriptor names, checked against its dtype/shape."""
    name = desc.get("name")
    if not isinstance(name, str):
        raise TensorCodecError('a tensor reference needs a "name"')
    block = _block_id(desc.get(BLOCK_FIELD), limits)
    cached = blocks.get(block)
    if cached is None:
        raise ProtocolError(
            f"operand block {block[:80]!r} is not cached here", code=ErrorCode.MISSING_BLOCK
        )
    if dtype_name(cached.dtype) != desc.get("dtype") or list(cached.shape) != desc.get("shape"):
        raise TensorCodecError(f"operand block {block[:80]!r} does not match its reference")
    return name, cached


@dataclass(frozen=True)
class Received:
    message: Message
    frame: Frame

    def tensors(self, limits: WireLimits = DEFAULT_LIMITS) -> dict[str, torch.Tensor]:
        return decode_tensors(self.frame.header.get("tensors", []), self.frame.payload, limits)


def parse_message(
    data: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS
) -> Received:
    """Decode and validate one received message. Raises ProtocolError subclasses only."""
    if isinstance(data, str):
        raise ProtocolError("text messages are not part of the protocol; send binary frames")
    frame = decode_frame(data, limits)
    if frame.header["v"] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {frame.header['v']} is not supported (this side speaks "
            f"{PROTOCOL_VERSION})",
            code=ErrorCode.VERSION,
        )
    cls = MESSAGE_TYPES.get(frame.type)
    if cls is None:
        raise ProtocolError(
            f"unknown message type {frame.type[:64]!r}", code=ErrorCode.UNKNOWN_TYPE
        )
    return Received(message=cls.from_header(frame.header, limits), frame=frame)
