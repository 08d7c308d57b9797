"""Fused attention and convolutions lowered to GEMMs (coordinator.step.lowering): the same
values as torch's own kernels, forward and backward, and no fused op left in a trace."""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any

import pytest
import torch
from support.real_models import make_cnn_job, make_sdpa_job

from coordinator.step import lowering
from coordinator.step.eager import EagerOffloadMode
from coordinator.step.tracing import GEMM_OPS, trace_step

aten = torch.ops.aten


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


# ---- attention ---------------------------------------------------------------------------

# fp32: the lowering and the fused kernel differ only in summation order. bf16: both round
# scores and probabilities to bf16 (8 bits) at different points, so they differ by about
# one bf16 step (2^-8) of the largest entry.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 3e-2}


@pytest.mark.parametrize(
    "dtype,causal,masked,cross",
    [
        (dtype, causal, masked, cross)
        for dtype, causal, masked, cross in itertools.product(
            (torch.float32, torch.bfloat16), (False, True), (False, True), (False, True)
        )
        if not (causal and cross)  # torch's causal mask for L != S is its own corner
    ],
)
def test_attention_matches_the_fused_cpu_kernel(
    dtype: torch.dtype, causal: bool, masked: bool, cross: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 24, 16, generator=gen).to(dtype)
    s = 40 if cross else 24
    k = torch.randn(2, 3, s, 16, generator=gen).to(dtype)
    v = torch.randn(2, 3, s, 16, generator=gen).to(dtype)
    mask = torch.randn(24, s, generator=gen).to(dtype) if masked else None
    kwargs: dict[str, Any] = {"attn_mask": mask, "scale": 0.3 if masked else None}
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, **kwargs)
    got_out, got_lse = lowering.flash_attention_cpu(q, k, v, 0.0, causal, **kwargs)
    tol = TOLERANCE[dtype]
    assert rel(got_out.float(), out.float()) < tol
    assert rel(got_lse, lse) < tol
    grad = torch.randn(out.shape, generator=gen).to(dtype)
    want = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, **kwargs
    )
    got = lowering.flash_attention_cpu_backward(grad, q, k, v, out, lse, 0.0, causal, **kwargs)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert rel(g.float(), w.float()) < tol


def test_attention_with_dropout_is_left_to_the_fused_kernel() -> None:
    q = torch.randn(1, 1, 4, 4)
    assert lowering.flash_attention_cpu(q, q, q, 0.1) is NotImplemented


def test_a_traced_transformer_step_has_its_attention_as_bmm() -> None:
    job = make_sdpa_job(seq=32, batch=2)
    x, y = job.next_batch()
    traced = trace_step(job, x, y)
    names = {str(n.target) for n in traced.graph.nodes if n.op == "call_function"}
    assert not [n for n in names if "scaled_dot_product" in n], names
    bmm = [n for n in traced.gemm_nodes() if GEMM_OPS[n.target] == "bmm"]  # type: ignore[index]
    # Per layer: q kᵀ and p v forward; the scores again, dv, dp, dq and dk backward.
    assert len(bmm) == 2 * 7


# ---- convolutions ------------------------------------------------------------------------

CONV_CASES = [
    # (dims, stride, padding, dilation, groups, bias, kernel)
    (2, 1, 1, 1, 1, True, 3),
    (2, 2, 0, 1, 1, False, 3),
    (2, 1, 2, 2, 2, True, 3),
    (2, (2, 1), (1, 0), (1, 2), 1, True, 3),
    (2, 3, 2, 1, 1, False, 3),  # stride 3: rows the forward pass never reached
    (2, 1, 3, 1, 1, True, 3),  # padding wider than the kernel reaches
    (2, 2, 0, 1, 1, False, 1),  # a ResNet downsampling shortcut
    (2, 1, 2, 1, 2, True, 5),
    (1, 1, 1, 1, 1, True, 3),
    (1, 2, 3, 2, 2, False, 3),
    (3, 1, 1, 1, 1, True, 3),  # a 3-D U-Net's or a video network's convolution
    (3, 2, 1, 1, 2, False, 3),
    (3, (2, 1, 1), (0, 1, 1), (1, 2, 1), 1, True, 3),
    (3, (1, 2, 2), (2, 0, 1), (2, 1, 1), 1, False, 3),
    (3, 1, 0, 1, 1, False, 1),
]


def _conv_case(
    dims: int,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    bias: bool,
    kernel: int,
    dtype: Any,
) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(1)
    spatial = {1: (13,), 2: (9, 11), 3: (6, 7, 5)}[dims]
    x = torch.randn(3, 8, *spatial, generator=gen, dtype=dtype)
    w = torch.randn(16, 8 // groups, *((kernel,) * dims), generator=gen, dtype=dtype)
    b = torch.randn(16, generator=gen, dtype=dtype) if bias else None

    def per_dim(v: Any) -> tuple[int, ...]:
        return v if isinstance(v, tuple) else (v,) * dims

    return x, w, b, per_dim(stride), per_dim(padding), per_dim(dilation), (0,) * dims, groups


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_convolution_and_its_backward_match_torch(case: Any, dtype: Any, tol: float) -> None:
    bias = case[5]
    x, w, b, st, pd, dl, op, groups = _conv_case(*case, dtype=dtype)
    want = aten.convolution(x, w, b, st, pd, dl, False, op, groups)
    got = lowering.convolution(x, w, b, st, pd, dl, False, op, groups)
    assert got.shape == want.shape and rel(got, want) < tol
    grad = torch.randn_like(want)
    sizes = [16] if bias else None
    mask = [True, True, bias]
    want_g = aten.convolution_backward(grad, x, w, sizes, st, pd, dl, False, op, groups, mask)
    got_g = lowering.convolution_backward(grad, x, w, sizes, st, pd, dl, False, op, groups, mask)
    for g, wg in zip(got_g, want_g, strict=True):
        if wg is None:
            assert g is None
        else:
            assert g.shape == wg.shape and rel(g, wg) < tol


TRANSPOSED_CASES = [
    # (dims, stride, padding, dilation, output_padding, groups, bias, kernel)
    (2, 2, 1, 1, 0, 1, True, 4),  # a DCGAN generator's upsampling
    (2, 2, 1, 1, 1, 1, False, 3),  # output_padding: the odd row a U-Net decoder adds
    (2, 2, 0, 1, 0, 1, True, 2),  # a U-Net's 2x2 up-convolution
    (2, 1, 1, 1, 0, 1, True, 3),
    (2, 1, 0, 2, 0, 2, True, 3),
    (2, (2, 1), (1, 0), 1, (1, 0), 1, True, 3),
    (2, 3, 2, 1, 2, 1, False, 3),
    (1, 4, 2, 1, 0, 1, True, 8),  # a vocoder's 1-D upsampling
    (1, 2, 1, 1, 1, 2, False, 3),
    (3, 2, 0, 1, 0, 1, True, 2),  # a 3-D U-Net decoder's 2x2x2 up-convolution
    (3, 2, 1, 1, 1, 2, False, 3),
    (3, (1, 2, 2), (0, 1, 1), 1, (0, 1, 1), 1, True, 3),
]


@pytest.mark.parametrize("case", TRANSPOSED_CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_transposed_convolution_and_its_backward_match_torch(
    case: Any, dtype: Any, tol: float
) -> None:
    dims, stride, padding, dilation, output_padding, groups, bias, kernel = case
    gen = torch.Generator().manual_seed(2)
    spatial = {1: (13,), 2: (7, 9), 3: (3, 5, 4)}[dims]
    x = torch.randn(3, 16, *spatial, generator=gen, dtype=dtype)
    w = torch.randn(16, 16 // groups, *((kernel,) * dims), generator=gen, dtype=dtype)
    b = torch.randn(16, generator=gen, dtype=dtype) if bias else None

    def per_dim(v: Any) -> tuple[int, ...]:
        return v if isinstance(v, tuple) else (v,) * dims

    args = (per_dim(stride), per_dim(padding), per_dim(dilation), True, per_dim(output_padding))
    want = aten.convolution(x, w, b, *args, groups)
    got = lowering.convolution(x, w, b, *args, groups)
    assert got is not NotImplemented
    assert got.shape == want.shape and rel(got, want) < tol
    grad = torch.randn_like(want)
    sizes = [16] if bias else None
    mask = [True, True, bias]
    want_g = aten.convolution_backward(grad, x, w, sizes, *args, groups, mask)
    got_g = lowering.convolution_backward(grad, x, w, sizes, *args, groups, mask)
    for g, wg in zip(got_g, want_g, strict=True):
        if wg is None:
            assert g is None
        else:
            assert g.shape == wg.shape and rel(g, wg) < tol


def test_convolutions_without_a_useful_gemm_stay_as_they_are() -> None:
    x = torch.randn(2, 8, 6, 6)
    depthwise = torch.randn(8, 1, 3, 3)
    args = ((1, 1), (1, 1), (1, 1))
    assert lowering.convolution(x, depthwise, None, *args, False, (0, 0), 8) is NotImplemented
    # Transposed: three output channels (an image's colours) make GEMMs too narrow; an
    # output_padding on a stride-1 side has no input-gradient form.
    to_rgb = torch.randn(8, 3, 3, 3)
    assert lowering.convolution(x, to_rgb, None, *args, True, (0, 0), 1) is NotImplemented
    dilated = ((1, 1), (1, 1), (2, 2))
    weight = torch.randn(8, 8, 3, 3)
    assert lowering.convolution(x, weight, None, *dilated, True, (1, 1), 1) is NotImplemented
    x3, w3 = torch.randn(1, 8, 4, 4, 4), torch.randn(8, 3, 3, 3, 3)
    three = ((1, 1, 1), (1, 1, 1), (1, 1, 1))
    assert lowering.convolution(x3, w3, None, *three, True, (0, 0, 0), 1) is NotImplemented


def test_a_traced_cnn_step_has_no_convolution_left() -> None:
    job = make_cnn_job(batch=4, size=16)
    x, y = job.next_batch()
    traced = trace_step(job, x, y)
    names = {str(n.target) for n in traced.graph.nodes if n.op == "call_function"}
    assert not [n for n in names if "convolution" in n], names
    # Every GEMM over patches is one unfold_mm node, whose tiles carry image blocks:
    # 7 convolutions, one grouped in 2, so 8 forward and 8 weight-gradient GEMMs; input
    # gradients for all but the first (its input is the batch), the strided one folded
    # here from a plain mm.
    assert not [n for n in names if "im2col" in n], names
    assert len([n for n in traced.graph.nodes if "col2im" in str(n.target)]) == 1
    kinds = [GEMM_OPS[n.target] for n in traced.gemm_nodes()]  # type: ignore[index]
    assert kinds.count("unfold_mm") == 8 + 8 + 6


@pytest.mark.parametrize(
    "kv_heads,mask_kind,causal",
    [(4, None, True), (2, None, True), (2, "bool", False), (4, "float", False), (1, None, False)],
)
def test_scaled_dot_product_attention_as_models_call_it(
    kv_heads: int, mask_kind: str | None, causal: bool
) -> None:
    """F.scaled_dot_product_attention end to end, forward and backward, with grouped-query
    heads and boolean masks (torch converts them before the fused kernel), lowered by the
    same dispatch mode the eager fallback uses."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 32, 16, generator=gen)
    k = torch.randn(2, kv_heads, 32, 16, generator=gen)
    v = torch.randn(2, kv_heads, 32, 16, generator=gen)
    mask: torch.Tensor | None = None
    if mask_kind == "bool":
        mask = torch.rand(32, 32, generator=gen) > 0.3
        mask[:, 0] = True
    elif mask_kind == "float":
        mask = torch.randn(32, 32, generator=gen)
    grad = torch.randn(2, 4, 32, 16, generator=gen)

    def run(lowered: bool) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        mode = EagerOffloadMode(None, threading.Event(), "t")
        with mode if lowered else contextlib.nullcontext():
            out = torch.nn.functional.scaled_dot_product_attention(
                *leaves, attn_mask=mask, is_causal=causal, enable_gqa=kv_heads != 4
            )
            out.backward(grad)
        if lowered:
            assert "_scaled_dot_product_flash_attention_for_cpu" not in mode.stats.flops.kept
            assert mode.stats.flops.kept.get("bmm", 0) > 0
        return [out.detach()] + [t.grad for t in leaves]  # type: ignore[misc]

    for got, want in zip(run(True), run(False), strict=True):
        assert got.shape == want.shape and rel(got, want) < 2e-6


# ---- GEMMs with a scaled sum --------------------------------------------------------------


@pytest.mark.parametrize("op", ["baddbmm", "addbmm"])
@pytest.mark.parametrize(("beta", "alpha"), [(1, 1), (0.5, 2.0), (0, 0.125)])
def test_gemms_with_a_scaled_sum_are_gemms_for_workers(op: str, beta: float, alpha: float) -> None:
    gen = torch.Generator().manual_seed(5)
    b1, b2 = torch.randn(3, 16, 24, generator=gen), torch.randn(3, 24, 8, generator=gen)
    bias = torch.randn(16, 8, generator=gen)  # broadcast over the batch for baddbmm
    if beta == 0:
        bias = torch.full_like(bias, float("nan"))  # not read: torch leaves NaN out
    grad = torch.randn(3, 16, 8, generator=gen) if op == "baddbmm" else torch.randn(16, 8)

    def run(lowered: bool) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (b1, b2)]
        mode = EagerOffloadMode(None, threading.Event(), "t")
        with mode if lowered else contextlib.nullcontext():
            out = getattr(torch, op)(bias, *leaves, beta=beta, alpha=alpha)
            out.backward(grad)
        if lowered:
            # Only GEMMs, whose tiles workers would take (no offload here: kept).
            assert set(mode.stats.flops.kept) <= {"bmm", "mm"}, mode.stats.flops.kept
            assert not mode.stats.flops.uncounted
        return [out.detach()] + [t.grad for t in leaves]  # type: ignore[misc]

    for got, want in zip(run(True), run(False), strict=True):
        assert not got.isnan().any()
        assert got.shape == want.shape and rel(got, want) < 2e-6
