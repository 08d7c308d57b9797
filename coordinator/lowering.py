"""Heavy ops that are not GEMMs, rewritten as GEMMs so that their work can go to workers.

Workers only ever multiply matrices (a data-only op from a fixed whitelist), so fused
attention and convolutions are lowered, at capture time, into ``aten.bmm`` / ``aten.mm``
plus cheap ops that stay at the coordinator:

- **Attention** (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, the
  fused kernels torch picks on CPU): scores ``q kᵀ`` and ``p v`` as bmm, softmax here;
  the backward recomputes the probabilities from the saved log-sum-exp, as the fused
  kernel does, and its four products are bmm too.
- **Convolutions** (``convolution`` and ``convolution_backward``, 1-D and 2-D, any
  stride, padding, dilation and groups): implicit GEMM. The input is unfolded into
  patches (im2col) and the convolution becomes ``patches @ weightᵀ`` per group; the
  weight gradient is ``grad_outᵀ @ patches`` and the input gradient ``grad_out @
  weight`` folded back (col2im). Every returned tile is then checked like any GEMM tile.

The table is keyed by aten overload and used as ``make_fx``'s decomposition table and by
the eager fallback (``coordinator.eager``). A lowering returns ``NotImplemented`` for the
cases it does not cover (transposed or 3-D convolutions, groups too narrow to make useful
tiles, dropout inside the fused kernel); those ops then run at the coordinator as they are,
and the FLOP accounting names them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

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


def _probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    is_causal: bool,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Scores as a bmm in the operands' dtype, softmax in float32 (as the fused kernel
    accumulates): returns (probabilities fp32 (..., L, S), log-sum-exp fp32, scale)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    batch = q.shape[:-2]
    L, S = q.shape[-2], k.shape[-2]
    scores = torch.bmm(_heads(q), _heads(k).transpose(1, 2)).view(*batch, L, S).float() * scale
    bias = _attention_bias(q, k, is_causal, attn_mask)
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    # A row with every key masked has lse = -inf: the fused kernel returns zeros there.
    p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return p, lse, scale


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
    p, lse, _ = _probabilities(query, key, is_causal, attn_mask, scale)
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
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    batch, L, S = query.shape[:-2], query.shape[-2], k.shape[-2]
    scores = torch.bmm(_heads(query), _heads(k).transpose(1, 2)).view(*batch, L, S).float() * scale
    bias = _attention_bias(query, k, is_causal, attn_mask)
    if bias is not None:
        scores = scores + bias
    p = torch.exp(scores - logsumexp.unsqueeze(-1)).nan_to_num(0.0)
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


def _as_2d(
    x: torch.Tensor, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]
) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
    """A 1-D convolution is a 2-D one over a height of 1."""
    if x.dim() == 3:
        return x.unsqueeze(2), [1, *stride], [0, *padding], [1, *dilation]
    return x, list(stride), list(padding), list(dilation)


def _lowerable(weight: torch.Tensor, transposed: bool, groups: int) -> bool:
    return (
        not transposed
        and weight.dim() in (3, 4)
        and weight.shape[0] // groups >= MIN_GROUP_CHANNELS
    )


def _patches(
    x4: torch.Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> list[torch.Tensor]:
    """im2col, one (N·positions, C/groups·kernel) matrix per group: the GEMMs' A operand."""
    cols = torch.nn.functional.unfold(
        x4, tuple(kernel), tuple(dilation), tuple(padding), tuple(stride)
    )  # (N, C·kk, positions)
    per_group = cols.shape[1] // groups
    return [
        cols[:, g * per_group : (g + 1) * per_group].transpose(1, 2).reshape(-1, per_group)
        for g in range(groups)
    ]


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
    if not _lowerable(weight, transposed, groups) or input.dim() != weight.dim():
        return NotImplemented
    one_d = input.dim() == 3
    x4, st, pd, dl = _as_2d(input, stride, padding, dilation)
    w4 = weight.unsqueeze(2) if one_d else weight
    out_ch, kernel = w4.shape[0], tuple(w4.shape[2:])
    n, h, w = x4.shape[0], x4.shape[2], x4.shape[3]
    ho = (h + 2 * pd[0] - dl[0] * (kernel[0] - 1) - 1) // st[0] + 1
    wo = (w + 2 * pd[1] - dl[1] * (kernel[1] - 1) - 1) // st[1] + 1
    og = out_ch // groups
    w_groups = w4.reshape(groups, og, -1)  # (groups, O/g, C/g·kk)
    outs = [
        torch.mm(a, w_groups[g].t())  # (N·positions, O/g)
        for g, a in enumerate(_patches(x4, kernel, st, pd, dl, groups))
    ]
    out = outs[0] if groups == 1 else torch.cat(outs, dim=1)
    out = out.view(n, ho, wo, out_ch).permute(0, 3, 1, 2)
    if bias is not None:
        out = out + bias.view(1, -1, 1, 1)
    out = out.contiguous()
    return out.squeeze(2) if one_d else out


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
    if not _lowerable(weight, transposed, groups) or input.dim() != weight.dim():
        return NotImplemented
    one_d = input.dim() == 3
    x4, st, pd, dl = _as_2d(input, stride, padding, dilation)
    w4 = weight.unsqueeze(2) if one_d else weight
    g4 = grad_output.unsqueeze(2) if one_d else grad_output
    out_ch, kernel = w4.shape[0], tuple(w4.shape[2:])
    og = out_ch // groups
    # grad_out as the GEMMs see it: (N·positions, O), one column block per group.
    go = g4.permute(0, 2, 3, 1).reshape(-1, out_ch)
    w_groups = w4.reshape(groups, og, -1)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        n, positions = x4.shape[0], g4.shape[2] * g4.shape[3]
        parts = [
            torch.mm(go[:, g * og : (g + 1) * og], w_groups[g])  # (N·positions, C/g·kk)
            .view(n, positions, -1)
            .transpose(1, 2)
            for g in range(groups)
        ]
        cols = parts[0] if groups == 1 else torch.cat(parts, dim=1)
        grad_input = torch.nn.functional.fold(
            cols.contiguous(), tuple(x4.shape[2:]), kernel, tuple(dl), tuple(pd), tuple(st)
        )
        grad_input = grad_input.squeeze(2) if one_d else grad_input
    if output_mask[1]:
        patches = _patches(x4, kernel, st, pd, dl, groups)
        grads = [torch.mm(go[:, g * og : (g + 1) * og].t(), a) for g, a in enumerate(patches)]
        grad_weight = (grads[0] if groups == 1 else torch.cat(grads, dim=0)).view(weight.shape)
    if output_mask[2]:
        grad_bias = g4.sum(dim=(0, 2, 3))
    return grad_input, grad_weight, grad_bias


LOWERINGS: dict[Any, Callable[..., Any]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: flash_attention_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
        flash_attention_cpu_backward
    ),
    aten.convolution.default: convolution,
    aten.convolution_backward.default: convolution_backward,
}
