"""Convolution tiles: a GEMM operand sent as an image block, unfolded by the worker.

The wire side (``common.unfold``, ``encode_task(..., unfold=)``): the spec is signed,
hostile values are refused with a clear error, and the worker's operands are exactly
the patch matrix the coordinator would have sent. The coordinator side (``TiledGemm``):
tiles are cut between images and channels, carry only their image block, and assemble
the product.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from common.errors import LimitExceeded, ProtocolError, SignatureError, TensorCodecError
from common.frames import decode_frame, encode_frame
from common.limits import WireLimits
from common.messages import Task, encode_task, parse_message, verify_task, verify_task_blocks
from common.signing import generate_private_key
from common.tensors import content_id
from common.unfold import Unfold
from coordinator.plan.planner import GemmShape, PlanConfig, plan_gemm
from coordinator.tiles.check_parts import new_generator
from coordinator.tiles.tiled_gemm import TiledGemm
from coordinator.tiles.verify import check_product

KEY = generate_private_key()
SPEC = Unfold("a", kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1))


def patches(image: torch.Tensor, spec: Unfold) -> torch.Tensor:
    """The patch matrix, written out independently of Unfold.expand."""
    cols = torch.nn.functional.unfold(image, spec.kernel, spec.dilation, spec.padding, spec.stride)
    return torch.cat([cols[i].t() for i in range(image.shape[0])])


@pytest.mark.parametrize(
    "spec",
    [
        SPEC,
        Unfold("a", (3, 2), (2, 1), (0, 2), (1, 2)),
        Unfold("b", (1, 1), (2, 2), (0, 0), (1, 1)),
        Unfold("b", (1, 5), (1, 1), (0, 2), (1, 1)),  # a 1-D convolution: height 1
    ],
    ids=str,
)
def test_the_worker_receives_the_patch_matrix(spec: Unfold) -> None:
    gen = torch.Generator().manual_seed(0)
    height = 1 if spec.kernel[0] == 1 and spec.kernel[1] == 5 else 7
    image = torch.randn(3, 4, height, 9, generator=gen)
    rows, cols = spec.matrix_shape(image.shape)
    other = torch.randn(cols, 5, generator=gen) if spec.operand == "a" else torch.randn(6, rows)
    a, b = (image, other) if spec.operand == "a" else (other, image)
    bundle = encode_task("t", "mm", a, b, KEY, unfold=spec)
    received = parse_message(bundle)
    assert isinstance(received.message, Task) and received.message.unfold == spec
    got_a, got_b = verify_task(received, KEY.public_key())
    want = patches(image, spec)
    expanded = got_a if spec.operand == "a" else got_b
    assert expanded.shape == (rows, cols) and torch.equal(expanded, want)
    assert torch.equal(got_b if spec.operand == "a" else got_a, other)
    # The bundle carries the image, not its patches.
    assert len(bundle) < 4 * (image.numel() + other.numel()) + 2048


def _tampered(bundle: bytearray, change: Any) -> bytes:
    frame = decode_frame(bundle)
    header = dict(frame.header)
    change(header)
    return bytes(encode_frame(header, [frame.payload]))


def test_the_unfold_spec_is_signed() -> None:
    a, b = torch.randn(1, 2, 5, 5), torch.randn(18, 3)
    bundle = encode_task("t", "mm", a, b, KEY, unfold=SPEC)

    def wider(header: dict[str, Any]) -> None:
        header["unfold"] = {**header["unfold"], "padding": [2, 2]}

    def dropped(header: dict[str, Any]) -> None:
        del header["unfold"]

    for change in (wider, dropped):
        with pytest.raises(SignatureError):
            verify_task(parse_message(_tampered(bundle, change)), KEY.public_key())


HOSTILE = [
    ({"operand": "c"}, "operand"),
    ({"kernel": [0, 3]}, "kernel"),
    ({"kernel": [3]}, "kernel"),
    ({"kernel": [3, 1 << 40]}, "kernel"),
    ({"stride": [True, 1]}, "stride"),
    ({"padding": [-1, 0]}, "padding"),
    ({"dilation": [1.5, 1]}, "dilation"),
    ({"padding": "wide"}, "padding"),
]


@pytest.mark.parametrize("change,field", HOSTILE, ids=[h[1] + str(h[0]) for h in HOSTILE])
def test_hostile_specs_are_refused_by_name(change: dict[str, Any], field: str) -> None:
    header = {**SPEC.to_header(), **change}
    with pytest.raises(ProtocolError, match=field):
        Unfold.from_header(header)


def test_a_spec_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(ProtocolError, match="object"):
        Unfold.from_header(["a"])


def _signed(a: torch.Tensor, b: torch.Tensor, spec: Unfold, op: str = "mm") -> bytes:
    """A correctly signed bundle whose contents a hostile coordinator chose."""
    bundle = encode_task("t", "mm", a, b, KEY, unfold=spec)
    if op == "mm":
        return bytes(bundle)
    frame = decode_frame(bundle)
    header = {**frame.header, "op": op}
    return bytes(encode_frame(header, [frame.payload]))


def test_unfold_only_with_mm() -> None:
    data = _signed(torch.randn(1, 2, 5, 5), torch.randn(18, 3), SPEC, op="bmm")
    with pytest.raises(ProtocolError, match="needs op"):
        parse_message(data)


@pytest.mark.parametrize(
    "a,b,spec,error,match",
    [
        (torch.randn(2, 5, 5), torch.randn(18, 3), SPEC, TensorCodecError, "image block"),
        (
            torch.randn(1, 2, 2, 2),
            torch.randn(18, 3),
            Unfold("a", (5, 5), (1, 1), (0, 0), (1, 1)),
            TensorCodecError,
            "does not fit",
        ),
        (torch.randn(1, 2, 5, 5), torch.randn(17, 3), SPEC, TensorCodecError, "shapes"),
        (torch.randn(1, 2, 5, 5), torch.randn(18, 3).double(), SPEC, TensorCodecError, "float64"),
    ],
    ids=["3-D image", "kernel larger than image", "wrong depth", "mixed dtypes"],
)
def test_operands_that_make_no_valid_patch_gemm_are_refused(
    a: torch.Tensor, b: torch.Tensor, spec: Unfold, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        verify_task(parse_message(_signed(a, b, spec)), KEY.public_key())


def test_a_patch_matrix_over_the_element_limit_is_refused() -> None:
    limits = WireLimits(max_tensor_elements=10_000)
    image = torch.randn(1, 4, 20, 20)  # 1,600 values, 14,400 in its patches
    data = _signed(image, torch.randn(36, 2), SPEC)
    with pytest.raises(LimitExceeded, match="unfolded operand"):
        verify_task(parse_message(data, limits), KEY.public_key(), limits)


def test_a_cached_image_block_is_unfolded_when_referred_to() -> None:
    image, w = torch.randn(2, 3, 6, 6), torch.randn(27, 4)
    ids = (content_id(image), content_id(w))
    first = parse_message(encode_task("t1", "mm", image, w, KEY, unfold=SPEC))
    (a1, _), cached = verify_task_blocks(first, KEY.public_key())
    assert set(cached) == set(ids) and torch.equal(cached[ids[0]], image)  # the raw block
    again = encode_task("t2", "mm", image, w, KEY, ids=ids, refs=frozenset({"a"}), unfold=SPEC)
    (a2, _), _ = verify_task_blocks(parse_message(again), KEY.public_key(), blocks=cached)
    assert torch.equal(a2, a1) and torch.equal(a1, patches(image, SPEC))


# ---- the coordinator's tiles ----------------------------------------------------------


@pytest.mark.parametrize("operand", ["a", "b"])
@pytest.mark.parametrize("target", [1, 3, 8, 64])
def test_tiles_carry_image_blocks_and_assemble_the_product(operand: str, target: int) -> None:
    gen = torch.Generator().manual_seed(target)
    spec = Unfold(operand, (3, 3), (1, 1), (1, 1), (1, 1))
    image = torch.randn(5, 6, 4, 4, generator=gen)  # 5 images x 16 positions, 6 x 9 columns
    rows, cols = spec.matrix_shape(image.shape)
    other = torch.randn(cols, 7, generator=gen) if operand == "a" else torch.randn(7, rows)
    a, b = (image, other) if operand == "a" else (other, image)
    m, k, n = (rows, cols, 7) if operand == "a" else (7, rows, cols)
    config = PlanConfig(min_offload_flops=1, min_tile_flops=1, target_tiles=target, min_tile_side=1)
    plan = plan_gemm(GemmShape("mm", 1, m, n, k, 4), config)
    assert plan is not None
    done: list[torch.Tensor] = []
    gemm = TiledGemm("g", plan, a, b, done.append, unfold=spec)
    jobs = list(gemm.iter_tiles(KEY))
    per_row, per_col = 16, 9  # one image's positions, one channel's kernel entries
    for job in jobs:
        r = job.region
        image_block = job.a if operand == "a" else job.b
        assert image_block.dim() == 4  # sent raw, not as patches
        if operand == "a":
            assert r.m0 % per_row == 0 and r.m1 % per_row == 0
            assert r.k0 % per_col == 0 and r.k1 % per_col == 0
        else:
            assert r.k0 % per_row == 0 and r.k1 % per_row == 0
            assert r.n0 % per_col == 0 and r.n1 % per_col == 0
        got_a, got_b = verify_task(parse_message(job.bundle.join()), KEY.public_key())
        assert torch.equal(got_a, job.matrices()[0]) and torch.equal(got_b, job.matrices()[1])
        assert job.ticket.down_bytes == 4 * (job.a.numel() + job.b.numel())
    random.Random(target).shuffle(jobs)
    for job in jobs:
        gemm.deliver(job.region, job.matrices()[0] @ job.matrices()[1])
    want = patches(image, spec) @ other if operand == "a" else other @ patches(image, spec)
    assert len(done) == 1
    torch.testing.assert_close(done[0], want, rtol=1e-5, atol=1e-5)
    # The check's cache tells an unfolded block from the same block sent raw.
    image_slot = 0 if operand == "a" else 1
    assert jobs[0].check_blocks[image_slot] != jobs[0].blocks[image_slot]
    assert jobs[0].check_blocks[1 - image_slot] == jobs[0].blocks[1 - image_slot]


def test_a_result_over_differently_padded_patches_fails_the_check() -> None:
    """A worker that pads image borders by replication instead of zeros (a bug or a cheat
    that only touches the edges) returns a result of the right shape; the coordinator's
    check, over the patches it unfolds itself, rejects it, and passes the honest one."""
    gen = torch.Generator().manual_seed(5)
    spec = Unfold("a", (3, 3), (1, 1), (1, 1), (1, 1))
    image, weight = torch.randn(4, 8, 12, 12, generator=gen), torch.randn(72, 16, generator=gen)
    job_a, job_b = spec.matrices(image, weight)
    honest = job_a @ job_b
    padded = torch.nn.functional.pad(image, (1, 1, 1, 1), mode="replicate")
    edge_cheat = Unfold("a", (3, 3), (1, 1), (0, 0), (1, 1)).expand(padded) @ weight
    assert edge_cheat.shape == honest.shape and not torch.allclose(edge_cheat, honest)
    assert check_product(job_a, job_b, honest, new_generator()).ok
    assert not check_product(job_a, job_b, edge_cheat, new_generator()).ok
