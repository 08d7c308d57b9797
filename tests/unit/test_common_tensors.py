"""Tensor codec: bit-exact round trips, zero-copy views, and every descriptor it must refuse."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from common.errors import LimitExceeded, ProtocolError, TensorCodecError
from common.frames import PAYLOAD_ALIGN, decode_frame, encode_frame
from common.limits import WireLimits
from common.tensors import (
    DTYPES,
    content_id,
    decode_tensors,
    dtype_name,
    encode_block,
    encode_tensors,
)

WIRE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SAME_SIZE_INT = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float64: torch.int64,
}
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (2, 3), (2, 3, 4), (2, 3, 4, 5)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(SAME_SIZE_INT[t.dtype])


def _assert_bit_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))


def _sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    flat = t.reshape(-1)
    specials = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0]
    for i, value in enumerate(specials[: flat.numel()]):
        flat[i] = value
    return t


def _round_trip(named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Through a whole frame, as the wire carries it."""
    descriptors, parts = encode_tensors(named)
    frame = decode_frame(encode_frame({"type": "t", "v": 1, "tensors": descriptors}, parts))
    return decode_tensors(frame.header["tensors"], frame.payload)


def _desc(**overrides: Any) -> dict[str, Any]:
    desc: dict[str, Any] = {
        "name": "a",
        "dtype": "float32",
        "shape": [2, 2],
        "offset": 0,
        "nbytes": 16,
    }
    desc.update(overrides)
    return desc


PAYLOAD = memoryview(bytes(256))


# ---- round trips -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _sample(shape, dtype)
    out = _round_trip([("x", t)])
    assert list(out) == ["x"]
    _assert_bit_exact(out["x"], t)


@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=str)
def test_round_trip_non_contiguous(dtype: torch.dtype) -> None:
    base = _sample((6, 8), dtype, seed=1)
    transposed = base.t()
    strided = base[::2, 1::3]
    expanded = base[0:1].expand(4, 8)  # stride 0
    permuted = _sample((2, 3, 4, 5), dtype, seed=2).permute(3, 1, 0, 2)
    assert not transposed.is_contiguous() and not permuted.is_contiguous()
    named = [("t", transposed), ("s", strided), ("e", expanded), ("p", permuted)]
    out = _round_trip(named)
    for name, t in named:
        _assert_bit_exact(out[name], t)


def test_round_trip_mixed_dtypes_and_offsets_are_aligned() -> None:
    named = [
        ("a", _sample((3,), torch.float16)),  # 6 bytes: next offset needs padding
        ("b", _sample((5, 3), torch.float64)),
        ("z", torch.empty((0, 4), dtype=torch.float32)),
        ("c", _sample((1, 1), torch.bfloat16)),
    ]
    descriptors, parts = encode_tensors(named)
    assert [d["name"] for d in descriptors] == ["a", "b", "z", "c"]
    for d, (_, t) in zip(descriptors, named, strict=True):
        assert d["offset"] % PAYLOAD_ALIGN == 0
        assert d["dtype"] == dtype_name(t.dtype)
        assert d["shape"] == list(t.shape)
        assert d["nbytes"] == t.numel() * t.element_size()
    payload = b"".join(bytes(p) for p in parts)
    assert len(payload) == descriptors[-1]["offset"] + descriptors[-1]["nbytes"]
    out = decode_tensors(descriptors, memoryview(payload))
    for name, t in named:
        _assert_bit_exact(out[name], t)


def test_requires_grad_input_is_encoded() -> None:
    t = torch.randn(3, 3, requires_grad=True)
    out = _round_trip([("g", t * 2)])
    _assert_bit_exact(out["g"], (t * 2).detach())
    assert not out["g"].requires_grad


def test_empty_tensor_list() -> None:
    descriptors, parts = encode_tensors([])
    assert descriptors == [] and parts == []
    assert decode_tensors([], memoryview(b"")) == {}


# ---- zero copy -----------------------------------------------------------------------


def test_decoded_tensors_view_the_payload_without_copying() -> None:
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    descriptors, parts = encode_tensors([("a", a), ("b", b)])
    data = bytearray(encode_frame({"type": "t", "v": 1, "tensors": descriptors}, parts))
    frame = decode_frame(data)
    out = decode_tensors(frame.header["tensors"], frame.payload)
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    payload_start = len(data) - len(frame.payload)
    for d in descriptors:
        assert out[d["name"]].data_ptr() == base + payload_start + d["offset"]
    # mutate the received buffer: the decoded tensor sees it
    data[payload_start : payload_start + 4] = torch.tensor([42.0]).numpy().tobytes()
    assert out["a"][0, 0].item() == 42.0


def test_decode_from_immutable_bytes_shares_memory_and_warns_nothing() -> None:
    a = torch.arange(16, dtype=torch.float32)
    descriptors, parts = encode_tensors([("a", a)])
    data = encode_frame({"type": "t", "v": 1, "tensors": descriptors}, parts)
    frame = decode_frame(data)
    import warnings

    # Under the process's filters (torch warns about a read-only buffer once a process,
    # and common.tensors ignores that): a filter of "error" here would override them.
    with warnings.catch_warnings(record=True) as caught:
        out = decode_tensors(frame.header["tensors"], frame.payload)
    assert [str(w.message) for w in caught] == []
    assert torch.equal(out["a"], a)
    # the view points into the bytes object, not into a private copy
    assert out["a"].data_ptr() != a.data_ptr()
    import ctypes

    start = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert start is not None
    assert start <= out["a"].data_ptr() < start + len(data)


def test_misaligned_offset_is_copied_correctly() -> None:
    value = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32)
    payload = b"\x00" + value.numpy().tobytes()
    out = decode_tensors([_desc(shape=[3], offset=1, nbytes=12)], memoryview(payload))
    assert torch.equal(out["a"], value)


def test_zero_size_tensor_at_payload_end() -> None:
    out = decode_tensors([_desc(shape=[0, 5], offset=0, nbytes=0)], memoryview(b""))
    assert out["a"].shape == (0, 5) and out["a"].dtype == torch.float32


# ---- refused inputs: encode side -------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64],
    ids=str,
)
def test_encode_refuses_dtypes_off_the_whitelist(dtype: torch.dtype) -> None:
    with pytest.raises(TensorCodecError, match="not allowed on the wire"):
        encode_tensors([("x", torch.zeros(2, 2, dtype=dtype))])


def test_dtype_whitelist_is_exactly_the_four_floats() -> None:
    assert set(DTYPES) == {"float32", "float16", "bfloat16", "float64"}


# ---- refused inputs: decode side -------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [
        "int64",
        "bool",
        "uint8",
        "Float32",
        "torch.float32",
        "float",
        "",
        None,
        3,
        3.5,
        True,
        [],
        {},
        ["float32"],
    ],
)
def test_decode_refuses_dtypes(dtype: Any) -> None:
    with pytest.raises(TensorCodecError, match="dtype"):
        decode_tensors([_desc(dtype=dtype)], PAYLOAD)


@pytest.mark.parametrize("nbytes", [0, 15, 17, 32, 8])
def test_nbytes_mismatch(nbytes: int) -> None:
    with pytest.raises(TensorCodecError, match="does not match shape"):
        decode_tensors([_desc(nbytes=nbytes)], PAYLOAD)


def test_nbytes_is_checked_per_dtype() -> None:
    with pytest.raises(TensorCodecError, match="does not match"):
        decode_tensors([_desc(dtype="float16", nbytes=16)], PAYLOAD)
    out = decode_tensors([_desc(dtype="float16", nbytes=8)], PAYLOAD)
    assert out["a"].dtype == torch.float16


@pytest.mark.parametrize("offset", [241, 256, 1000, 1 << 40, 10**200])
def test_offset_past_payload(offset: int) -> None:
    with pytest.raises(TensorCodecError, match="run past"):
        decode_tensors([_desc(offset=offset)], PAYLOAD)


def test_offset_exactly_at_end_is_fine() -> None:
    out = decode_tensors([_desc(offset=240)], PAYLOAD)
    assert out["a"].shape == (2, 2)


@pytest.mark.parametrize("field", ["offset", "nbytes"])
@pytest.mark.parametrize("value", [-1, -(10**30), True, False, 0.0, 16.0, "0", None, [0], {}])
def test_bad_integer_fields(field: str, value: Any) -> None:
    with pytest.raises(TensorCodecError, match=f'"{field}" must be a non-negative integer'):
        decode_tensors([_desc(**{field: value})], PAYLOAD)


@pytest.mark.parametrize("field", ["offset", "nbytes"])
def test_missing_integer_fields(field: str) -> None:
    desc = _desc()
    del desc[field]
    with pytest.raises(TensorCodecError, match=field):
        decode_tensors([desc], PAYLOAD)


@pytest.mark.parametrize("dim", [-1, True, False, 2.0, "2", None, [2], float("nan")])
def test_bad_dims(dim: Any) -> None:
    with pytest.raises(TensorCodecError, match="non-negative integers"):
        decode_tensors([_desc(shape=[2, dim])], PAYLOAD)


@pytest.mark.parametrize("shape", [None, "2,2", 4, {"0": 2}, (2, 2)])
def test_shape_not_a_list(shape: Any) -> None:
    with pytest.raises(TensorCodecError, match='"shape" must be a list'):
        decode_tensors([_desc(shape=shape)], PAYLOAD)


def test_too_many_dims() -> None:
    with pytest.raises(LimitExceeded, match="max_ndim=4"):
        decode_tensors([_desc(shape=[1, 1, 1, 1, 1], nbytes=4)], PAYLOAD)
    huge_rank = [1] * 10_000
    with pytest.raises(LimitExceeded, match="max_ndim"):
        decode_tensors([_desc(shape=huge_rank, nbytes=4)], PAYLOAD)


def test_dim_over_limit() -> None:
    limits = WireLimits(max_dim=8)
    with pytest.raises(LimitExceeded, match="max_dim=8"):
        decode_tensors([_desc(shape=[9], nbytes=36)], PAYLOAD, limits)
    with pytest.raises(LimitExceeded, match="max_dim"):
        decode_tensors([_desc(shape=[10**300, 0], nbytes=0)], PAYLOAD)
    assert decode_tensors([_desc(shape=[8], nbytes=32)], PAYLOAD, limits)["a"].shape == (8,)


def test_elements_over_limit() -> None:
    limits = WireLimits(max_tensor_elements=15)
    with pytest.raises(LimitExceeded, match="max_tensor_elements=15"):
        decode_tensors([_desc(shape=[4, 4], nbytes=64)], PAYLOAD, limits)
    # with the default limits, dims each under max_dim but a product over the element cap
    big = 1 << 24
    with pytest.raises(LimitExceeded, match="max_tensor_elements"):
        decode_tensors([_desc(shape=[big, big, big, big], nbytes=4 * big**4)], PAYLOAD)


def test_too_many_tensors() -> None:
    descs = [_desc(name=f"t{i}", shape=[0], nbytes=0) for i in range(9)]
    with pytest.raises(LimitExceeded, match="max_tensors=8"):
        decode_tensors(descs, PAYLOAD)
    assert len(decode_tensors(descs[:8], PAYLOAD)) == 8


def test_duplicate_names() -> None:
    with pytest.raises(TensorCodecError, match="appears twice"):
        decode_tensors([_desc(), _desc(offset=64)], PAYLOAD)


@pytest.mark.parametrize("name", ["", None, 1, True, ["a"], "x" * 257])
def test_bad_names(name: Any) -> None:
    with pytest.raises(TensorCodecError, match="name"):
        decode_tensors([_desc(name=name)], PAYLOAD)


def test_name_at_length_limit_is_fine() -> None:
    assert list(decode_tensors([_desc(name="x" * 256)], PAYLOAD)) == ["x" * 256]


@pytest.mark.parametrize("desc", [None, [], "a", 1, ["a", "float32", [2, 2], 0, 16]])
def test_non_dict_descriptor(desc: Any) -> None:
    with pytest.raises(TensorCodecError, match="must be an object"):
        decode_tensors([desc], PAYLOAD)


@pytest.mark.parametrize("descriptors", [None, {}, "abc", 3, {"a": _desc()}])
def test_descriptors_not_a_list(descriptors: Any) -> None:
    with pytest.raises(TensorCodecError, match="must be a list"):
        decode_tensors(descriptors, PAYLOAD)


def test_every_codec_error_is_a_protocol_error_with_a_code() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_tensors([_desc(dtype="int64")], PAYLOAD)
    assert info.value.code == "bad_tensor"
    with pytest.raises(ProtocolError) as info:
        decode_tensors([_desc(shape=[1] * 5)], PAYLOAD)
    assert info.value.code == "limit_exceeded"


@pytest.mark.parametrize(
    ("make", "transposed"),
    [
        (lambda w: w, False),  # contiguous
        (lambda w: w[1:4, 2:5], False),  # rows of a wider matrix
        (lambda w: w[2:5], False),  # whole rows: in row order already
        (lambda w: w.mT, True),  # a weight as the B operand
        (lambda w: w.mT[1:5, :3], True),  # a block of it
        (lambda w: w.mT[:, :1], False),  # one column: any order is row order
        (lambda w: w.reshape(2, 3, 4).mT, True),  # batched
    ],
)
@pytest.mark.parametrize("share", [False, True])
def test_encode_block_lays_a_transposed_view_out_as_its_transpose(
    make: Any, transposed: bool, share: bool
) -> None:
    w = torch.randn(6, 4)
    t = make(w)
    block = encode_block(t, share=share)
    assert block.transposed is transposed
    assert torch.equal(block.tensor, t)  # the operand itself, whatever the layout
    assert block.stored.is_contiguous()
    assert block.id == content_id(block.stored)
    stored_bytes = block.stored.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert bytes(block.data) == stored_bytes
    # Shared: a view of the operand's own bytes where they lie in row order already.
    in_order = (t.mT if transposed else t).is_contiguous()
    assert (block.stored.data_ptr() == t.data_ptr()) is (share and in_order)
    w.add_(1.0)  # a copy does not see what happens to its operand afterwards
    assert torch.equal(block.tensor, t) is (share and in_order)
