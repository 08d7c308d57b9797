"""Tasks and results: a signed tile bundle, made without copying its operands, verified
operand by operand on the way in; and the product that comes back."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

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
from common.frames import (
    PAYLOAD_ALIGN,
    Buffer,
    FrameParts,
    canonical_json,
    head_length,
    head_of,
)
from common.limits import DEFAULT_LIMITS, WireLimits
from common.message_fields import number, text
from common.ops import TILE_OPS, TileOp
from common.signing import (
    SIGNATURE_FIELD,
    SIGNATURE_HEX_LEN,
    signed_header_json,
    signed_json,
    task_digest,
    verify_bundle,
)
from common.tensors import (
    Block,
    content_id,
    decode_tensors,
    dtype_name,
    encode_block,
    stored_layout,
)
from common.unfold import UNFOLD_FIELD, Unfold

if TYPE_CHECKING:
    from common.messages import Received


BLOCK_FIELD = "block"  # a task operand's content id: signed, and its cache key
REF_FIELD = "ref"  # true: the operand is not in the payload; the worker has that block
# true: the block holds the operand's transpose (its last two dims swapped), in row order
TRANSPOSED_FIELD = "transposed"


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
        op = text(h, "op", "task", limits)
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
            tile_id=text(h, "tile_id", "task", limits),
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
            tile_id=text(h, "tile_id", "result", limits),
            compute_s=number(h, "compute_s", "result", hi=1e6),
            tensors=tensors,
        )


class LazyTask:
    """A task whose signature is made when it is first sent alone; sent in a batch, it
    goes unsigned and the batch's one signature vouches for it (``common.batches``).
    Small tasks are made this way: an Ed25519 signature costs more than the rest of a
    small task's making. Sized and joinable as the signed frame would be."""

    __slots__ = ("unsigned", "payload", "key", "_signed", "_nbytes")

    def __init__(self, unsigned: bytes, payload: Sequence[Buffer], key: Ed25519PrivateKey) -> None:
        self.unsigned = unsigned  # the canonical header JSON, without "sig"
        self.payload = payload
        self.key = key
        self._signed: FrameParts | None = None
        # The signed frame's length: its header gains the "sig" member (``signed_json``).
        signed_body = len(unsigned) + len(',"sig":""') + SIGNATURE_HEX_LEN
        self._nbytes = head_length(signed_body) + sum(memoryview(p).nbytes for p in payload)

    def signed(self) -> FrameParts:
        if self._signed is None:
            self._signed = FrameParts(
                [head_of(signed_json(self.key, self.unsigned)), *self.payload]
            )
        return self._signed

    def vouched(self) -> bytes:
        """The frame without a signature of its own, for a signed batch."""
        return b"".join([head_of(self.unsigned), *self.payload])

    def digest(self) -> str:
        return task_digest(self.unsigned)

    def __len__(self) -> int:
        return self._nbytes

    def join(self) -> bytes:
        return self.signed().join()


_ZEROS = memoryview(bytes(PAYLOAD_ALIGN))


def task_frame(
    tile_id: str,
    op: str,
    a: Block,
    b: Block,
    key: Ed25519PrivateKey,
    *,
    refs: frozenset[str] = frozenset(),
    unfold: Unfold | None = None,
    lazy: bool = False,
) -> FrameParts | LazyTask:
    """A signed task bundle for ``a @ b`` (with ``unfold``: one of them an image block
    standing for its patch matrix), made of the blocks themselves: nothing is copied
    or hashed here, only the header is built and signed. The signature covers each
    operand's content id (``Block.id``), which binds the operand's bytes. ``lazy``: a
    ``LazyTask``, signed when it is first sent alone.

    Operand cache: an operand whose name is in ``refs`` is not sent at all, only
    referred to by its id (the worker must hold it from an earlier task).
    """
    if op not in TILE_OPS:
        raise ValueError(f"op {op!r} is not one of {TILE_OPS}")
    descriptors: list[dict[str, Any]] = []
    parts: list[memoryview] = []
    offset = 0
    for name, block in (("a", a), ("b", b)):
        t = block.stored
        desc: dict[str, Any] = {"name": name, "dtype": dtype_name(t.dtype)}
        desc["shape"], desc[BLOCK_FIELD] = list(t.shape), block.id
        if block.transposed:
            desc[TRANSPOSED_FIELD] = True
        if name in refs:
            desc[REF_FIELD] = True
        else:
            # Laid out as the codec lays out tensors: each at the next aligned offset.
            gap = -offset % PAYLOAD_ALIGN
            if gap:
                parts.append(_ZEROS[:gap])
            offset += gap
            desc["offset"], desc["nbytes"] = offset, block.nbytes
            parts.append(block.data)
            offset += block.nbytes
        descriptors.append(desc)
    header: dict[str, Any] = {
        "type": Task.TYPE,
        "v": PROTOCOL_VERSION,
        "tile_id": tile_id,
        "op": op,
        "tensors": descriptors,
        **({UNFOLD_FIELD: unfold.to_header()} if unfold is not None else {}),
    }
    if lazy:
        return LazyTask(canonical_json(header), parts, key)
    return FrameParts([head_of(signed_header_json(key, header)), *parts])


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
        # Not sent: its dtype, shape, layout and id.
        return Block(t, memoryview(b""), block_id, stored_layout(t)[1])

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
    if received.voucher is not None and SIGNATURE_FIELD not in received.frame.header:
        received.voucher.verify(key, received.frame.header)  # its batch's one signature
    else:
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
    for desc in descriptors:
        if isinstance(desc, dict) and _transposed(desc):
            tensors[desc["name"]] = _swapped(tensors[desc["name"]])
    task = received.message
    return check_operands(task.op, tensors, limits, task.unfold), cacheable


def _transposed(desc: dict[str, Any]) -> bool:
    value = desc.get(TRANSPOSED_FIELD, False)
    if not isinstance(value, bool):
        raise TensorCodecError(f'tensor field "{TRANSPOSED_FIELD}" must be true or false')
    return value


def _swapped(t: torch.Tensor) -> torch.Tensor:
    """A transposed block's operand: a view of its bytes with the last two dims swapped."""
    if t.dim() < 2:
        raise TensorCodecError(f"a {t.dim()}-D operand cannot be transposed")
    return t.mT


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
