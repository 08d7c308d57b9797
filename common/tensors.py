"""Tensor codec: raw little-endian bytes described in the header, never pickle.

A message's tensors are described by ``{"name", "dtype", "shape", "offset", "nbytes"}``
entries; offsets are relative to the payload and 64-byte aligned. Decoding returns
tensors that *view* the received buffer: they are read-only by contract (the worker
only reads operands; the coordinator copies results into its own outputs).
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import torch

from common.errors import LimitExceeded, TensorCodecError
from common.frames import PAYLOAD_ALIGN
from common.limits import DEFAULT_LIMITS, WireLimits

# The dtype whitelist. Everything else is refused by name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little endian
    raise ImportError("Cleave's tensor codec assumes a little-endian host")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TensorCodecError(f"dtype {dtype} is not allowed on the wire") from None


def encode_tensors(
    tensors: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[dict[str, Any]], list[memoryview | bytes]]:
    """Describe and lay out tensors for a payload: (descriptors, payload parts)."""
    descriptors: list[dict[str, Any]] = []
    parts: list[memoryview | bytes] = []
    offset = 0
    for name, tensor in tensors:
        dtype = dtype_name(tensor.dtype)  # refuse before touching the data
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        # Flatten before the byte view: a 0-d tensor cannot be viewed as another dtype.
        raw = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
        pad = (-offset) % PAYLOAD_ALIGN
        if pad:
            parts.append(b"\0" * pad)
            offset += pad
        descriptors.append(
            {
                "name": name,
                "dtype": dtype,
                "shape": list(t.shape),
                "offset": offset,
                "nbytes": len(raw),
            }
        )
        parts.append(raw)
        offset += len(raw)
    return descriptors, parts


def _int_field(desc: dict[str, Any], key: str) -> int:
    value = desc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TensorCodecError(f'tensor descriptor field "{key}" must be a non-negative integer')
    return value


def _shape(desc: dict[str, Any], limits: WireLimits) -> list[int]:
    shape = desc.get("shape")
    if not isinstance(shape, list):
        raise TensorCodecError('tensor descriptor field "shape" must be a list')
    if len(shape) > limits.max_ndim:
        raise LimitExceeded(f"tensor has {len(shape)} dims, max_ndim={limits.max_ndim}")
    for dim in shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise TensorCodecError("tensor dims must be non-negative integers")
        if dim > limits.max_dim:
            raise LimitExceeded(f"tensor dim {dim} exceeds max_dim={limits.max_dim}")
    if math.prod(shape) > limits.max_tensor_elements:
        raise LimitExceeded(
            f"tensor of {math.prod(shape)} elements exceeds "
            f"max_tensor_elements={limits.max_tensor_elements}"
        )
    return shape


def decode_tensors(
    descriptors: Any, payload: memoryview, limits: WireLimits = DEFAULT_LIMITS
) -> dict[str, torch.Tensor]:
    """Rebuild tensors from descriptors and a payload. Raises TensorCodecError/LimitExceeded."""
    if not isinstance(descriptors, list):
        raise TensorCodecError('"tensors" must be a list of descriptors')
    if len(descriptors) > limits.max_tensors:
        raise LimitExceeded(f"{len(descriptors)} tensors exceed max_tensors={limits.max_tensors}")
    out: dict[str, torch.Tensor] = {}
    for desc in descriptors:
        if not isinstance(desc, dict):
            raise TensorCodecError("a tensor descriptor must be an object")
        name = desc.get("name")
        if not isinstance(name, str) or not name or len(name) > limits.max_string_chars:
            raise TensorCodecError("a tensor descriptor needs a short non-empty string name")
        if name in out:
            raise TensorCodecError(f"tensor name {name!r} appears twice")
        # A hostile descriptor may carry an unhashable dtype (a list, an object): look up
        # strings only, so it is refused as TensorCodecError rather than raising TypeError.
        raw_dtype = desc.get("dtype")
        dtype = DTYPES.get(raw_dtype) if isinstance(raw_dtype, str) else None
        if dtype is None:
            raise TensorCodecError(
                f"tensor {name!r}: dtype {desc.get('dtype')!r} is not one of {sorted(DTYPES)}"
            )
        shape = _shape(desc, limits)
        offset = _int_field(desc, "offset")
        nbytes = _int_field(desc, "nbytes")
        itemsize = dtype.itemsize  # no throwaway tensor per call
        if nbytes != math.prod(shape) * itemsize:
            raise TensorCodecError(
                f"tensor {name!r}: nbytes={nbytes} does not match shape {shape} of {desc['dtype']}"
            )
        if offset + nbytes > len(payload):
            raise TensorCodecError(
                f"tensor {name!r}: bytes [{offset}, {offset + nbytes}) run past the "
                f"{len(payload)}-byte payload"
            )
        out[name] = _view(payload, offset, nbytes, dtype, shape)
    return out


# Received frames are immutable bytes; the tensors decoded from them are read-only by
# contract, and copying every operand would cost a noticeable share of a tile's time.
# Said once for the process: warnings.catch_warnings around each decode cost more than
# the decode, and it swaps the process-wide filters under other threads decoding too.
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)


def _view(
    payload: memoryview, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]
) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    itemsize = dtype.itemsize  # no throwaway tensor per call
    if offset % itemsize:
        # Misaligned for the dtype: copy rather than reinterpret unaligned memory.
        chunk = bytearray(payload[offset : offset + nbytes])
        return torch.frombuffer(chunk, dtype=dtype).reshape(shape)
    flat = torch.frombuffer(payload, dtype=dtype, count=nbytes // itemsize, offset=offset)
    return flat.reshape(shape)


CONTENT_ID_HEX_LEN = 64


def content_id(t: torch.Tensor) -> str:
    """An operand's content id: BLAKE3 (256 bits) of its wire dtype, shape and bytes.

    A task's signature covers the ids of its operands, so an operand is bound to what
    the coordinator signed once the worker recomputes its id; the id also names the
    block in the worker's operand cache. Keyed by content, not position, because one
    tensor feeds several GEMMs of a step (an activation is the A operand of a layer's
    forward GEMM and the B operand of its weight-gradient GEMM): such a block is sent,
    and hashed, once.
    """
    hasher = blake3.blake3(f"{dtype_name(t.dtype)}|{','.join(map(str, t.shape))}|".encode())
    if t.numel():
        hasher.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return hasher.hexdigest()


def stored_layout(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``t`` as its elements lie in memory: ``(t.mT, True)`` when its last two dims are
    swapped there (a transposed view, such as a linear layer's weight as the B operand),
    else ``(t, False)``. Copying ``t.mT`` reads and writes rows; copying a transposed
    view into row order jumps across memory for every element, several times slower."""
    if t.dim() >= 2 and t.shape[-1] > 1 and t.shape[-2] > 1 and t.stride(-2) == 1 != t.stride(-1):
        return t.mT, True
    return t, False


@dataclass(frozen=True)
class Block:
    """An operand laid out for the wire once, for every task that carries it: its bytes
    contiguous in row order, and its id. A task puts each block at the next
    ``PAYLOAD_ALIGN`` boundary of its payload, zero padding between them.

    A transposed block holds the operand's transpose (its last two dims swapped) in row
    order: ``tensor`` is the operand, a transposed view of those bytes, and ``id`` is the
    bytes' content id, as the worker computes it before it swaps them back."""

    tensor: torch.Tensor  # the operand exactly as the worker computes with it
    data: memoryview  # the bytes of ``stored``
    id: str  # content_id of ``stored``, or the id a caller asserts for it
    transposed: bool = False

    @property
    def stored(self) -> torch.Tensor:
        """The operand as its bytes lie: row order."""
        return self.tensor.mT if self.transposed else self.tensor

    @functools.cached_property
    def nbytes(self) -> int:
        """(Cached: each task that carries the block asks, and each asking is two torch
        calls.)"""
        return self.tensor.numel() * self.tensor.element_size()


def encode_block(t: torch.Tensor, block_id: str | None = None, *, share: bool = False) -> Block:
    """``t`` (any strides, any device) as a ``Block``, hashed unless its id is given: a
    copy of its bytes in row order, made once (a transposed view is copied as its
    transpose: ``stored_layout``), in memory from torch's allocator, which does not
    zero it first (a bytearray would: every byte would be written twice).

    ``share``: where ``t``'s bytes already lie in row order in CPU memory, the block is a
    view of them, not a copy, and the caller keeps them unchanged while the block is in
    use (a GEMM's operands while its tiles are out)."""
    dtype_name(t.dtype)  # refuse before touching the data
    source, transposed = stored_layout(t.detach())
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        stored = torch.empty(source.shape, dtype=t.dtype)
        data = memoryview(b"")
    else:
        if share and source.device.type == "cpu" and source.is_contiguous():
            stored = source
        else:
            stored = torch.empty(source.shape, dtype=t.dtype)
            stored.copy_(source)
        # An ndarray of the bytes is a buffer; uint8, as numpy has no bfloat16.
        data = memoryview(stored.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    tensor = stored.mT if transposed else stored
    return Block(tensor, data, block_id or content_id(stored), transposed)
