"""Heavy ops that are not GEMMs, rewritten as GEMMs so that their work can go to workers.

Workers only ever multiply matrices (a data-only op from a fixed whitelist), so fused
attention and convolutions are lowered, at capture time, into ``aten.bmm`` / ``aten.mm``
plus cheap ops that stay at the coordinator:

- **Attention** (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, the
  fused kernels torch picks on CPU): scores ``q kᵀ`` and ``p v`` as bmm, softmax here;
  the backward recomputes the scores and, from the saved log-sum-exp, the probabilities
  (as the fused kernel does), then ``dv``, ``dp``, ``dq`` and ``dk`` as bmm.
- **Convolutions** (``convolution`` and ``convolution_backward``, 1-D and 2-D, any
  stride, padding, dilation and groups): implicit GEMM over a patch matrix (im2col), per
  group: the output is ``patches(input) @ weightᵀ``, the weight gradient
  ``grad_outᵀ @ patches(input)``, and the input gradient of a stride-1 convolution
  ``patches(grad_out) @ flipped weight`` (a strided one: ``grad_out @ weight``, folded
  back here). A transposed convolution is the input gradient of the convolution with its
  weight, and its backward that convolution's forward and weight gradient; a 3-D
  convolution a 2-D one over depth-stacked frames. GEMMs with a
  patch operand are ``cleave::unfold_mm`` nodes: their tiles carry image blocks, which
  workers unfold themselves (``common.unfold``), so the wire carries each image once
  instead of its kernel-size-times larger patch matrix. Every returned tile is a plain
  GEMM tile, checked like any other.
- **GEMMs with a scaled sum** (``baddbmm``, as older attention code adds a bias to its
  scores; ``addbmm``): the bmm, or for ``addbmm`` one mm over the batch and the inner
  dimension together, and the scaled sum here.

The table is keyed by aten overload and used as ``make_fx``'s decomposition table and by
the eager fallback (``coordinator.step.eager``). A lowering returns ``NotImplemented`` for the
cases it does not cover (groups too narrow to make useful tiles,
dropout inside the fused kernel); those ops then run at the coordinator as they are,
and the FLOP accounting names them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from common.unfold import Unfold

aten = torch.ops.aten

# A group's GEMM with fewer output channels than this (depthwise convolutions) makes tiles
# too narrow to be worth sending: the native kernel here is faster than its unfolded GEMMs.
MIN_GROUP_CHANNELS = 8


# ---- attention --------------------------------------------------------------------------


def _heads(t: torch.Tensor) -> torch.Tensor:
    """(..., L, E) -> (batch·heads, L, E): the batch of a bmm."""
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def _attention_bias(
    q: torch.Tensor, k: torch.Tensor, is_causal: bool, attn_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """The additive score bias of the mask arguments, broadcastable to (..., L, S)."""
    L, S = q.shape[-2], k.shape[-2]
    bias = None
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        bias = torch.zeros(L, S, dtype=torch.float32, device=q.device).masked_fill(
            ~keep, float("-inf")
        )
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            m = torch.zeros(attn_mask.shape, dtype=torch.float32, device=q.device)
            m = m.masked_fill(~attn_mask, float("-inf"))
        else:
            m = attn_mask.float()
        bias = m if bias is None else bias + m
    return bias


def _repeat_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves q.heads / kv.heads query heads."""
    if t.dim() >= 3 and t.shape[-3] != q.shape[-3]:
        return t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3)
    return t


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    is_causal: bool,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, float]:
    """Scaled, masked scores (..., L, S) in float32 (as the fused kernel accumulates),
    their product a bmm in the operands' dtype; and the scale used."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    batch, L, S = q.shape[:-2], q.shape[-2], k.shape[-2]
    scores = torch.bmm(_heads(q), _heads(k).transpose(1, 2)).view(*batch, L, S).float() * scale
    bias = _attention_bias(q, k, is_causal, attn_mask)
    return (scores if bias is None else scores + bias), scale


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # A row with every key masked has lse = -inf: the fused kernel returns zeros there.
    return torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)


def flash_attention_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> Any:
    if dropout_p != 0.0:
        return NotImplemented  # the fused kernel's own RNG: keep it as it is
    key, value = _repeat_kv(query, key), _repeat_kv(query, value)
    scores, _ = _scores(query, key, is_causal, attn_mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    p = _probabilities(scores, lse)
    batch, L = query.shape[:-2], query.shape[-2]
    out = torch.bmm(_heads(p.to(value.dtype)), _heads(value)).view(*batch, L, value.shape[-1])
    return out, lse


def flash_attention_cpu_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> Any:
    if dropout_p != 0.0:
        return NotImplemented
    kv_heads = key.shape[-3] if key.dim() >= 3 else None
    k, v = _repeat_kv(query, key), _repeat_kv(query, value)
    scores, scale = _scores(query, k, is_causal, attn_mask, scale)
    p = _probabilities(scores, logsumexp)
    batch, L, S = query.shape[:-2], query.shape[-2], k.shape[-2]
    dt = query.dtype
    go = _heads(grad_out)
    grad_v = torch.bmm(_heads(p.to(dt)).transpose(1, 2), go).view(*batch, S, v.shape[-1])
    grad_p = torch.bmm(go, _heads(v).transpose(1, 2)).view(*batch, L, S).float()
    delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
    grad_s = (p * (grad_p - delta) * scale).to(dt)
    grad_q = torch.bmm(_heads(grad_s), _heads(k)).view(query.shape)
    grad_k = torch.bmm(_heads(grad_s).transpose(1, 2), _heads(query)).view(*batch, S, k.shape[-1])
    if kv_heads is not None and kv_heads != query.shape[-3]:
        # Each key/value head's gradient sums over the query heads it served.
        group = query.shape[-3] // kv_heads
        grad_k = grad_k.unflatten(-3, (kv_heads, group)).sum(-3)
        grad_v = grad_v.unflatten(-3, (kv_heads, group)).sum(-3)
    return grad_q, grad_k.to(key.dtype), grad_v.to(value.dtype)


# ---- convolutions -------------------------------------------------------------------------


@torch.library.custom_op("cleave::unfold_mm", mutates_args=())
def unfold_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    operand: str,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> torch.Tensor:
    """``a @ b`` where operand ``operand`` is an image block standing for its patch
    matrix (``common.unfold.Unfold``): one node in the trace, tiles of image blocks."""
    a_m, b_m = unfold_spec(operand, kernel, stride, padding, dilation).matrices(a, b)
    return a_m @ b_m


@unfold_mm.register_fake
def _unfold_mm_shape(
    a: torch.Tensor,
    b: torch.Tensor,
    operand: str,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> torch.Tensor:
    spec = unfold_spec(operand, kernel, stride, padding, dilation)
    if operand == "a":
        rows, _ = spec.matrix_shape(a.shape)
        return a.new_empty((rows, b.shape[1]))
    _, cols = spec.matrix_shape(b.shape)
    return a.new_empty((a.shape[0], cols))


def unfold_spec(
    operand: str,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> Unfold:
    def pair(v: Sequence[int]) -> tuple[int, int]:
        return int(v[0]), int(v[1])

    return Unfold(operand, pair(kernel), pair(stride), pair(padding), pair(dilation))


class _Geometry(NamedTuple):
    """A convolution's stride, padding and dilation per spatial dimension, and groups."""

    stride: Sequence[int]
    padding: Sequence[int]
    dilation: Sequence[int]
    groups: int

    def planar(self) -> _Geometry:
        """A 1-D convolution's, as a 2-D one over a height of 1."""
        s, p, d, g = self
        return _Geometry([1, *s], [0, *p], [1, *d], g)

    def frames(self) -> _Geometry:
        """A 3-D convolution's without its depth: its 2-D one over depth-stacked frames."""
        s, p, d, g = self
        return _Geometry(s[1:], p[1:], d[1:], g)


def _lowerable(
    weight: torch.Tensor,
    transposed: bool,
    groups: int,
    stride: Sequence[int],
    output_padding: Sequence[int],
) -> bool:
    if weight.dim() not in (3, 4, 5) or weight.shape[0] // groups < MIN_GROUP_CHANNELS:
        return False
    if not transposed:
        return True
    # A transposed convolution's forward is a convolution's input gradient, whose GEMMs
    # are as wide as its own output channels; its input gradient a convolution, as wide
    # as its input channels (weight.shape[0] // groups, above). Extra output rows on a
    # stride-1 side (output_padding with dilation) have no such form.
    extra_rows = any(p > 0 and s == 1 for p, s in zip(output_padding, stride, strict=True))
    return weight.shape[1] >= MIN_GROUP_CHANNELS and not extra_rows


def convolution(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> Any:
    if (
        not _lowerable(weight, transposed, groups, stride, output_padding)
        or input.dim() != weight.dim()
    ):
        return NotImplemented
    geo = _Geometry(stride, padding, dilation, groups)
    if transposed:
        # The input gradient of the convolution with this weight (channels (C_in,
        # C_out/g) read as that convolution's (out, in/g)), at grad_out = input.
        size = _transposed_size(input, weight, geo, output_padding)
        out_shape = (input.shape[0], weight.shape[1] * groups, *size)
        out = _input_gradient(input, weight, out_shape, geo)
    else:
        out = _forward(input, weight, geo)
    if bias is not None:
        out = out + bias.view(1, -1, *[1] * (out.dim() - 2))
    return out


def convolution_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Sequence[int] | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
) -> Any:
    if (
        not _lowerable(weight, transposed, groups, stride, output_padding)
        or input.dim() != weight.dim()
    ):
        return NotImplemented
    geo = _Geometry(stride, padding, dilation, groups)
    grad_input = grad_weight = grad_bias = None
    if transposed:
        # The convolution whose input gradient the forward was, run forward on grad_out,
        # is the input gradient; the weight gradient is that convolution's, with the
        # roles of image and output gradient swapped.
        if output_mask[0]:
            grad_input = _forward(grad_output, weight, geo)
        if output_mask[1]:
            grad_weight = _weight_gradient(input, grad_output, weight, geo)
    else:
        if output_mask[0]:
            grad_input = _input_gradient(grad_output, weight, tuple(input.shape), geo)
        if output_mask[1]:
            grad_weight = _weight_gradient(grad_output, input, weight, geo)
    if output_mask[2]:
        grad_bias = grad_output.sum(dim=[0, *range(2, grad_output.dim())])
    return grad_input, grad_weight, grad_bias


# A convolution's three products, for 1-D (a 2-D one over a height of 1), 2-D and 3-D
# (`_volume*` below) images.


def _forward(x: torch.Tensor, w: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    if x.dim() == 5:
        return _volume(x, w, geo)
    if x.dim() == 3:
        return _forward_2d(x.unsqueeze(2), w.unsqueeze(2), geo.planar()).squeeze(2)
    return _forward_2d(x, w, geo)


def _input_gradient(
    g: torch.Tensor, w: torch.Tensor, input_shape: Sequence[int], geo: _Geometry
) -> torch.Tensor:
    if g.dim() == 5:
        return _volume_input_gradient(g, w, input_shape, geo)
    if g.dim() == 3:
        shape = (input_shape[0], input_shape[1], 1, input_shape[2])
        return _input_gradient_2d(g.unsqueeze(2), w.unsqueeze(2), shape, geo.planar()).squeeze(2)
    return _input_gradient_2d(g, w, input_shape, geo)


def _weight_gradient(
    g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, geo: _Geometry
) -> torch.Tensor:
    if g.dim() == 5:
        return _volume_weight_gradient(g, x, w, geo)
    if g.dim() == 3:
        planar = geo.planar()
        flat = _weight_gradient_2d(g.unsqueeze(2), x.unsqueeze(2), w.unsqueeze(2), planar)
    else:
        flat = _weight_gradient_2d(g, x, w, geo)
    return flat.view(w.shape)


def _forward_2d(x4: torch.Tensor, w4: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    """``patches(x) @ weightᵀ`` per group, the patches unfolded from the image."""
    st, pd, dl, groups = list(geo.stride), list(geo.padding), list(geo.dilation), geo.groups
    out_ch, kernel = w4.shape[0], tuple(w4.shape[2:])
    n, h, w = x4.shape[0], x4.shape[2], x4.shape[3]
    ho = (h + 2 * pd[0] - dl[0] * (kernel[0] - 1) - 1) // st[0] + 1
    wo = (w + 2 * pd[1] - dl[1] * (kernel[1] - 1) - 1) // st[1] + 1
    og = out_ch // groups
    cg = x4.shape[1] // groups
    w_groups = w4.reshape(groups, og, -1)  # (groups, O/g, C/g·kk)
    geometry = (list(kernel), st, pd, dl)
    outs = [
        # (N·positions, C/g·kk) @ (C/g·kk, O/g), the patches unfolded from the image.
        torch.ops.cleave.unfold_mm(x4[:, g * cg : (g + 1) * cg], w_groups[g].t(), "a", *geometry)
        for g in range(groups)
    ]
    out = outs[0] if groups == 1 else torch.cat(outs, dim=1)
    return out.view(n, ho, wo, out_ch).permute(0, 3, 1, 2).contiguous()


def _weight_gradient_2d(
    g4: torch.Tensor, x4: torch.Tensor, w4: torch.Tensor, geo: _Geometry
) -> torch.Tensor:
    """A convolution's weight gradient from its output gradient ``g4`` and its input
    image ``x4``: (O, C/g·kk), one row block per group."""
    stride, padding, dilation, groups = geo
    out_ch, kernel = w4.shape[0], tuple(w4.shape[2:])
    og, cg = out_ch // groups, x4.shape[1] // groups
    # grad_out as the GEMMs see it: (N·positions, O), one column block per group.
    go = g4.permute(0, 2, 3, 1).reshape(-1, out_ch)
    geometry = (list(kernel), list(stride), list(padding), list(dilation))
    grads = [
        # (O/g, N·positions) @ (N·positions, C/g·kk), the patches unfolded from the image.
        torch.ops.cleave.unfold_mm(
            go[:, g * og : (g + 1) * og].t(), x4[:, g * cg : (g + 1) * cg], "b", *geometry
        )
        for g in range(groups)
    ]
    return grads[0] if groups == 1 else torch.cat(grads, dim=0)


def _transposed_size(
    x: torch.Tensor, w: torch.Tensor, geo: _Geometry, output_padding: Sequence[int]
) -> list[int]:
    """A transposed convolution's output size, per spatial dimension."""
    stride, padding, dilation, _ = geo
    return [
        (x.shape[2 + i] - 1) * stride[i]
        - 2 * padding[i]
        + dilation[i] * (w.shape[2 + i] - 1)
        + output_padding[i]
        + 1
        for i in range(x.dim() - 2)
    ]


def _input_gradient_2d(
    g4: torch.Tensor, w4: torch.Tensor, input_shape: Sequence[int], geo: _Geometry
) -> torch.Tensor:
    """The input gradient as a convolution of grad_out with the flipped, channel-swapped
    weight (a stride-1 transposed convolution is one): its GEMM is over grad_out's
    patches, so its tiles carry grad_out's image blocks and return the input gradient
    itself, not the kernel-size-times larger patch gradient that col2im folds. Strided
    convolutions fold: as a convolution their gradient would multiply the zeros that
    stride inserts between grad_out's entries."""
    stride, padding, dilation, groups = geo
    n, c, h, w = input_shape
    out_ch, cg = w4.shape[0], w4.shape[1]
    og = out_ch // groups
    kernel = tuple(w4.shape[2:])
    if any(s > 1 for s in stride):
        return _input_gradient_folded_2d(g4, w4, input_shape, geo)
    reach = [dilation[i] * (kernel[i] - 1) for i in range(2)]
    image = g4
    conv_padding = [reach[i] - padding[i] for i in range(2)]
    if min(conv_padding) < 0:  # padding wider than the kernel reaches: crop instead
        image = torch.nn.functional.pad(
            image, (conv_padding[1], conv_padding[1], conv_padding[0], conv_padding[0])
        )
        conv_padding = [0, 0]
    # W'[c, o] = W[o, c] flipped in space, per group: (C/g, O/g·kk) as the GEMM's B.
    flipped = w4.flip(2, 3).reshape(groups, og, cg, -1).transpose(1, 2).reshape(groups, cg, -1)
    geometry = (list(kernel), [1, 1], conv_padding, list(dilation))
    parts = [
        torch.ops.cleave.unfold_mm(
            image[:, g * og : (g + 1) * og], flipped[g].t(), "a", *geometry
        )  # (N·H·W, C/g)
        for g in range(groups)
    ]
    grad = parts[0] if groups == 1 else torch.cat(parts, dim=1)
    return grad.view(n, h, w, c).permute(0, 3, 1, 2).contiguous()


def _input_gradient_folded_2d(
    g4: torch.Tensor, w4: torch.Tensor, input_shape: Sequence[int], geo: _Geometry
) -> torch.Tensor:
    """grad_out @ weight per group, the patch gradients folded back here (col2im)."""
    stride, padding, dilation, groups = geo
    n, out_ch = g4.shape[0], g4.shape[1]
    og, positions = out_ch // groups, g4.shape[2] * g4.shape[3]
    go = g4.permute(0, 2, 3, 1).reshape(-1, out_ch)
    w_groups = w4.reshape(groups, og, -1)
    parts = [
        torch.mm(go[:, g * og : (g + 1) * og], w_groups[g])  # (N·positions, C/g·kk)
        .view(n, positions, -1)
        .transpose(1, 2)
        for g in range(groups)
    ]
    cols = parts[0] if groups == 1 else torch.cat(parts, dim=1)
    return torch.nn.functional.fold(
        cols.contiguous(),
        tuple(input_shape[2:]),
        tuple(w4.shape[2:]),
        tuple(dilation),
        tuple(padding),
        tuple(stride),
    )


# A 3-D convolution is a 2-D one over depth-stacked frames: for each output frame, the
# kernel-depth input frames it reads, side by side as channels, convolved in 2-D with the
# weight's depth taps side by side too. Workers unfold 2-D image blocks; the stacking (the
# input once per kernel tap in depth) and the scatter of the input gradient back to the
# frames are done here.


def _depth_geometry(depth: int, w5: torch.Tensor, geo: _Geometry) -> tuple[int, int, int, int, int]:
    """(kernel depth, depth stride, depth padding, depth dilation, output depth) of a
    convolution over an input `depth` frames deep."""
    kd, sd, pd, dd = w5.shape[2], int(geo.stride[0]), int(geo.padding[0]), int(geo.dilation[0])
    return kd, sd, pd, dd, (depth + 2 * pd - dd * (kd - 1) - 1) // sd + 1


def _stacked_frames(x5: torch.Tensor, geometry: tuple[int, ...], groups: int) -> torch.Tensor:
    """(N·D_out, kd·C, H, W): output frame t's input frames, each group's channels
    ordered (tap, channel) as `_stacked_weight` orders them."""
    kd, sd, pd, dd, do = geometry
    n, c, _, h, w = x5.shape
    xp = torch.nn.functional.pad(x5, (0, 0, 0, 0, pd, pd))
    taps = torch.stack([xp[:, :, z * dd : z * dd + sd * (do - 1) + 1 : sd] for z in range(kd)], 1)
    taps = taps.view(n, kd, groups, c // groups, do, h, w).permute(0, 4, 2, 1, 3, 5, 6)
    return taps.reshape(n * do, kd * c, h, w)


def _stacked_weight(w5: torch.Tensor) -> torch.Tensor:
    """(O, C/g, kd, kh, kw) as (O, kd·C/g, kh, kw): the depth taps side by side."""
    o, cg, kd, kh, kw = w5.shape
    return w5.permute(0, 2, 1, 3, 4).reshape(o, kd * cg, kh, kw)


def _frames(g5: torch.Tensor) -> torch.Tensor:
    """(N, O, D, H, W) as (N·D, O, H, W): a 2-D batch of frames."""
    n, o, d = g5.shape[:3]
    return g5.permute(0, 2, 1, 3, 4).reshape(n * d, o, *g5.shape[3:])


def _volume(x5: torch.Tensor, w5: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    geometry = _depth_geometry(x5.shape[2], w5, geo)
    x4 = _stacked_frames(x5, geometry, geo.groups)
    out = _forward_2d(x4, _stacked_weight(w5), geo.frames())
    n, o, do = x5.shape[0], w5.shape[0], geometry[4]
    return out.view(n, do, o, *out.shape[2:]).permute(0, 2, 1, 3, 4).contiguous()


def _volume_input_gradient(
    g5: torch.Tensor, w5: torch.Tensor, input_shape: Sequence[int], geo: _Geometry
) -> torch.Tensor:
    n, c, d, h, w = input_shape
    kd, sd, pd, dd, do = _depth_geometry(d, w5, geo)
    stacked_shape = (n * do, kd * c, h, w)
    stacked = _input_gradient_2d(_frames(g5), _stacked_weight(w5), stacked_shape, geo.frames())
    groups = geo.groups
    taps = stacked.view(n, do, groups, kd, c // groups, h, w).permute(0, 3, 2, 4, 1, 5, 6)
    taps = taps.reshape(n, kd, c, do, h, w)
    padded = g5.new_zeros(n, c, d + 2 * pd, h, w)
    for z in range(kd):  # each tap's frames back where they were read from
        padded[:, :, z * dd : z * dd + sd * (do - 1) + 1 : sd] += taps[:, z]
    return padded[:, :, pd : pd + d].contiguous()


def _volume_weight_gradient(
    g5: torch.Tensor, x5: torch.Tensor, w5: torch.Tensor, geo: _Geometry
) -> torch.Tensor:
    x4 = _stacked_frames(x5, _depth_geometry(x5.shape[2], w5, geo), geo.groups)
    flat = _weight_gradient_2d(_frames(g5), x4, _stacked_weight(w5), geo.frames())
    # flat: (O, kd·C/g·kh·kw)
    o, cg, kd, kh, kw = w5.shape
    return flat.view(o, kd, cg, kh, kw).permute(0, 2, 1, 3, 4).contiguous()


# ---- GEMMs with a scaled sum --------------------------------------------------------------


def _scaled_sum(product: torch.Tensor, other: torch.Tensor, beta: Any, alpha: Any) -> torch.Tensor:
    """``beta * other + alpha * product``; with beta 0, ``other`` is not read (NaN in it
    stays out, as torch documents)."""
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return product + (other if beta == 1 else other * beta)


def baddbmm(
    self: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
) -> torch.Tensor:
    """Attention scores with a bias (ALiBi) or a scale, as older transformers models
    write them: a bmm, the rest here."""
    return _scaled_sum(aten.bmm.default(batch1, batch2), self, beta, alpha)


def addbmm(
    self: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
) -> torch.Tensor:
    """The sum of a batch of products is one GEMM over the batch and the inner dimension
    together: (n, b·m) @ (b·m, p)."""
    b, n, m = batch1.shape
    a = batch1.permute(1, 0, 2).reshape(n, b * m)
    product = aten.mm.default(a, batch2.reshape(b * m, batch2.shape[-1]))
    return _scaled_sum(product, self, beta, alpha)


LOWERINGS: dict[Any, Callable[..., Any]] = {
    aten.baddbmm.default: baddbmm,
    aten.addbmm.default: addbmm,
    aten._scaled_dot_product_flash_attention_for_cpu.default: flash_attention_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
        flash_attention_cpu_backward
    ),
    aten.convolution.default: convolution,
    aten.convolution_backward.default: convolution_backward,
}
