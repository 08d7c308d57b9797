"""Several protocol messages in one WebSocket message.

A small tile's task or result costs its sender and receiver more in per-message work
(websockets' framing, a pass through the event loop) than in bytes. So each side's
writer joins the small frames that are ready to go at once into one ``batch``:

``header {"type": "batch", "v": 4, "frames": [n1, n2, ...]} | payload``

where the payload is the frames themselves, each starting on a ``PAYLOAD_ALIGN``
boundary (zero padding between them), so the tensors inside stay as aligned as in a
frame of their own. Each inner frame is exactly the message it would have been alone,
and is handled as if it had arrived alone, in order. A batch holds no batch.

A small task (``LazyTask``) travels in a batch without a signature of its own: the
batch header then lists, for each inner frame, the task's digest (BLAKE3 of its
canonical header under the task domain; "" for a frame that is not vouched for) and is
signed once (``BATCH_DOMAIN``). The receiver checks that signature with the pinned key
and each vouched task's digest before it decodes the task (``Voucher``): one Ed25519
signature a batch instead of one a task, with the same binding of every operand byte.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, overload

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from common.errors import FrameError, LimitExceeded, ProtocolError, SignatureError
from common.frames import PAYLOAD_ALIGN, Buffer, FrameParts, canonical_json, encode_frame, head_of
from common.limits import WireLimits
from common.message_fields import wire_header
from common.signing import (
    BATCH_DOMAIN,
    SIGNATURE_FIELD,
    signed_json,
    task_digest,
    verify_bundle,
)
from common.task_messages import LazyTask

if TYPE_CHECKING:
    from common.messages import Received

Outgoing = bytes | FrameParts | LazyTask  # a frame to send, as either side holds it

DIGEST_HEX_LEN = 64  # task_digest: BLAKE3-256 in hex

# A frame at least this large is sent on its own: joining copies it, and its own
# WebSocket message costs little beside its bytes.
BATCH_BELOW_BYTES = 128 << 10


@dataclass(frozen=True)
class Batch:
    TYPE: ClassVar[str] = "batch"
    frames: tuple[int, ...]  # each inner frame's length, in order
    tasks: tuple[str, ...] = ()  # the digest of each task vouched for ("": none), or ()
    sig: str = ""

    def to_header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"frames": list(self.frames)}
        if self.tasks:
            header["tasks"] = list(self.tasks)
        if self.sig:
            header[SIGNATURE_FIELD] = self.sig
        return header

    @classmethod
    def from_header(cls, h: dict[str, Any], limits: WireLimits) -> Batch:
        sizes = h.get("frames")
        if not isinstance(sizes, list) or not sizes:
            raise ProtocolError('batch: field "frames" must be a non-empty list')
        if len(sizes) > limits.max_batch_frames:
            raise LimitExceeded(
                f"batch of {len(sizes)} frames exceeds max_batch_frames={limits.max_batch_frames}"
            )
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
            raise ProtocolError('batch: field "frames" must hold positive frame lengths')
        tasks = h.get("tasks", [])
        if not isinstance(tasks, list) or (tasks and len(tasks) != len(sizes)):
            raise ProtocolError('batch: field "tasks" must list one digest per frame')
        if not all(isinstance(t, str) and len(t) in (0, DIGEST_HEX_LEN) for t in tasks):
            raise ProtocolError('batch: field "tasks" must hold task digests or ""')
        sig = h.get(SIGNATURE_FIELD, "")
        if not isinstance(sig, str) or bool(sig) != any(tasks):
            raise ProtocolError("batch: a signature goes with task digests, and only with them")
        return cls(tuple(sizes), tuple(tasks), sig)


class Voucher:
    """What a signed batch says of one of its tasks: checked against the coordinator's
    key once per batch, whichever of its tasks asks first."""

    __slots__ = ("_seal", "digest")

    def __init__(self, seal: _Seal, digest: str) -> None:
        self._seal = seal
        self.digest = digest

    def verify(self, key: Ed25519PublicKey, task_header: dict[str, Any]) -> None:
        """Raise ``SignatureError`` unless the batch was signed by ``key`` and vouches
        for this task header (without "sig")."""
        self._seal.verify(key)
        try:
            unsigned = canonical_json(task_header)
        except (ValueError, RecursionError):
            raise SignatureError("task header cannot be canonicalised for verification") from None
        if task_digest(unsigned) != self.digest:
            raise SignatureError(
                "task does not match the digest its batch's signature covers (tampered in transit)"
            )


class _Seal:
    __slots__ = ("_header", "_verified")

    def __init__(self, header: dict[str, Any]) -> None:
        self._header = header
        self._verified: Ed25519PublicKey | None = None

    def verify(self, key: Ed25519PublicKey) -> None:
        if self._verified is not key:
            verify_bundle(key, self._header, BATCH_DOMAIN)
            self._verified = key


def vouchers(received: Received) -> list[Voucher | None]:
    """For each frame of a received batch, what vouches for it (None: a frame that must
    carry its own signature, if it needs one)."""
    batch = received.message
    assert isinstance(batch, Batch)
    if not batch.tasks:
        return [None] * len(batch.frames)
    seal = _Seal(received.frame.header)
    return [Voucher(seal, digest) if digest else None for digest in batch.tasks]


def batch_frame(frames: Iterable[Buffer | LazyTask]) -> bytes:
    """One ``batch`` message holding ``frames`` (each a whole protocol message); the
    ``LazyTask``s among them go unsigned, under one signature of the batch."""
    parts: list[Buffer] = []
    sizes: list[int] = []
    digests: list[str] = []
    key: Ed25519PrivateKey | None = None
    end = 0
    for frame in frames:
        if isinstance(frame, LazyTask):
            if key is not None and frame.key is not key:
                raise ValueError("a batch's tasks are signed with one key")
            key = frame.key
            digests.append(frame.digest())
            frame = frame.vouched()
        else:
            digests.append("")
        if parts and end % PAYLOAD_ALIGN:
            parts.append(bytes(-end % PAYLOAD_ALIGN))
            end += len(parts[-1])
        parts.append(frame)
        sizes.append(memoryview(frame).nbytes)
        end += sizes[-1]
    header = wire_header(Batch(tuple(sizes), tuple(digests) if key is not None else ()))
    if key is None:
        return encode_frame(header, parts)
    return b"".join([head_of(signed_json(key, canonical_json(header), BATCH_DOMAIN)), *parts])


def inner_frames(received: Received) -> list[memoryview]:
    """The frames a received batch holds (views of its payload), after checking that
    they fill it exactly, with only zero padding between them. Raises ``FrameError``:
    a batch that does not add up is not a framing the connection can be trusted with."""
    batch = received.message
    if not isinstance(batch, Batch):
        raise ProtocolError(f"expected a batch, got a {batch.TYPE!r} message")
    payload = received.frame.payload
    out: list[memoryview] = []
    at = 0
    for size in batch.frames:
        start = at + (-at % PAYLOAD_ALIGN) if out else 0
        if any(payload[at:start]):
            raise FrameError("batch has non-zero bytes between its frames")
        if start + size > len(payload):
            raise FrameError(
                f"batch frame of {size} bytes runs past its {len(payload)}-byte payload"
            )
        out.append(payload[start : start + size])
        at = start + size
    if at != len(payload):
        raise FrameError(f"batch has {len(payload) - at} bytes after its last frame")
    return out


@overload
def packed(frames: Iterable[bytes], most: int) -> Iterator[bytes]: ...


@overload
def packed(frames: Iterable[Outgoing], most: int) -> Iterator[bytes | FrameParts]: ...


def packed(frames: Iterable[Outgoing], most: int) -> Iterator[bytes | FrameParts]:
    """What to send for ``frames``, in order: runs of frames under ``BATCH_BELOW_BYTES``
    joined into batches of at most ``most`` frames, a run of one and every larger frame
    as it is (a ``LazyTask`` then signed)."""
    run: list[Outgoing] = []

    def alone(frame: Outgoing) -> bytes | FrameParts:
        return frame.signed() if isinstance(frame, LazyTask) else frame

    def flush() -> Iterator[bytes | FrameParts]:
        if len(run) == 1:
            yield alone(run[0])
        elif run:
            yield batch_frame(f.join() if isinstance(f, FrameParts) else f for f in run)
        run.clear()

    for frame in frames:
        if len(frame) >= BATCH_BELOW_BYTES:
            yield from flush()
            yield alone(frame)
            continue
        run.append(frame)
        if len(run) == most:
            yield from flush()
    yield from flush()
