"""``torch._grouped_mm`` (mixture-of-experts layers) as ordinary GEMMs, one per group.

A grouped GEMM multiplies each expert's slice of the tokens by that expert's weights in
one call. Its group offsets are data (how many tokens each expert was routed), known only
when the op runs, so a captured step keeps the op as one node and the executor splits it
here when it runs; the eager fallback splits it the same way. Each group's product is a
plain ``mm`` (or, for the 3-D x 3-D form, one ``bmm``) that goes to workers as checked
tiles like any other GEMM.

The four forms, as torch defines them (``offs`` holds cumulative group ends):

- 2-D x 3-D: ``a`` (M, K) rows grouped by ``offs``, ``b`` (G, K, N): rows of group g times
  ``b[g]``; output (M, N). Rows past the last offset are not any group's: torch leaves
  them unwritten, they are zero here.
- 3-D x 3-D: ``a`` (G, M, K), ``b`` (G, K, N), no offsets: a batched product.
- 2-D x 2-D: ``a`` (M, K) and ``b`` (K, N) with K grouped by ``offs`` (a weight gradient):
  output (G, M, N), an empty group's slice zero.
- 3-D x 2-D: ``a`` (G, M, K), ``b`` (K, N) with N grouped: output (M, N), columns of
  group g from ``a[g]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import is_fake

from common.ops import TileOp

if TYPE_CHECKING:
    from coordinator.step.executor import GemmOffload

GROUPED_MM = torch.ops.aten._grouped_mm.default

PieceDone = Callable[[int, "torch.Tensor | BaseException"], None]


@dataclass(frozen=True)
class Piece:
    """One group's product ``a @ b``, written to ``out[where]``."""

    group: int
    op: str  # TileOp.MM or TileOp.BMM
    a: torch.Tensor
    b: torch.Tensor
    where: tuple[slice | int, ...]

    @property
    def flops(self) -> int:
        batch = self.a.shape[0] if self.op == TileOp.BMM else 1
        return 2 * batch * self.a.shape[-2] * self.a.shape[-1] * self.b.shape[-1]

    def product_here(self) -> torch.Tensor:
        return torch.bmm(self.a, self.b) if self.op == TileOp.BMM else self.a @ self.b


@dataclass
class GroupedCall:
    """One ``_grouped_mm`` call split into its groups' products; ``put`` each product in
    as it arrives, in any order; ``out`` is the op's result once ``left`` is 0."""

    out: torch.Tensor
    pieces: list[Piece]
    left: int = field(init=False)

    def __post_init__(self) -> None:
        self.left = len(self.pieces)

    @property
    def flops(self) -> int:
        return sum(p.flops for p in self.pieces)

    def put(self, index: int, product: torch.Tensor) -> None:
        self.out[self.pieces[index].where] = product
        self.left -= 1


def _ends(offs: torch.Tensor, groups: int, extent: int) -> list[int] | None:
    ends = [int(e) for e in offs.tolist()]
    if len(ends) != groups or any(e < s for s, e in zip([0, *ends], ends, strict=False)):
        return None
    return ends if not ends or ends[-1] <= extent else None


def split_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> GroupedCall | None:
    """The call's groups as plain products, or None where the call is not one this splits
    (a bias, an output dtype other than the operands', offsets torch itself would reject):
    then it runs here as it is, and torch reports any error in it."""
    if bias is not None or (out_dtype is not None and out_dtype != a.dtype) or a.dtype != b.dtype:
        return None
    if not a.dtype.is_floating_point:
        return None
    if a.dim() == 3 and b.dim() == 3:
        if offs is not None or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
            return None
        out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype)
        return GroupedCall(out, [Piece(0, TileOp.BMM, a, b, (slice(None),))])
    if offs is None or offs.dim() != 1:
        return None
    pieces: list[Piece] = []
    if a.dim() == 2 and b.dim() == 3:  # rows of a grouped
        if a.shape[1] != b.shape[1] or (ends := _ends(offs, b.shape[0], a.shape[0])) is None:
            return None
        out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype)
        out[ends[-1] if ends else 0 :] = 0
        for g, (s, e) in enumerate(zip([0, *ends], ends, strict=False)):
            if e > s:
                pieces.append(Piece(g, TileOp.MM, a[s:e], b[g], (slice(s, e),)))
    elif a.dim() == 2 and b.dim() == 2:  # the shared dimension grouped
        if a.shape[1] != b.shape[0] or (ends := _ends(offs, len(offs), a.shape[1])) is None:
            return None
        out = torch.zeros(len(ends), a.shape[0], b.shape[1], dtype=a.dtype)
        for g, (s, e) in enumerate(zip([0, *ends], ends, strict=False)):
            if e > s:
                pieces.append(Piece(g, TileOp.MM, a[:, s:e], b[s:e], (g,)))
    elif a.dim() == 3 and b.dim() == 2:  # columns of b grouped
        if a.shape[2] != b.shape[0] or (ends := _ends(offs, a.shape[0], b.shape[1])) is None:
            return None
        out = torch.empty(a.shape[1], b.shape[1], dtype=a.dtype)
        out[:, ends[-1] if ends else 0 :] = 0
        for g, (s, e) in enumerate(zip([0, *ends], ends, strict=False)):
            if e > s:
                pieces.append(Piece(g, TileOp.MM, a[g], b[:, s:e], (slice(None), slice(s, e))))
    else:
        return None
    return GroupedCall(out, pieces)


def start_pieces(call: GroupedCall, offload: GemmOffload | None, name: str, done: PieceDone) -> int:
    """Hand each group's product to ``offload`` (or compute it here where the offload does
    not take it); ``done(index, product)`` comes once per piece, from any thread. Returns
    the FLOPs handed to workers."""
    sent = 0
    for i, piece in enumerate(call.pieces):
        started = 0
        if offload is not None:
            started = offload.start(
                f"{name}.g{piece.group}", piece.op, piece.a, piece.b, functools.partial(done, i)
            )
        if started:
            sent += started
        else:
            done(i, piece.product_here())
    return sent


def grouped_mm_flops(
    a: Any, b: Any, offs: Any = None, *args: Any, out_val: Any = None, **kwargs: Any
) -> int:
    """FLOPs of one call: exact where the offsets are real tensors (the call ran), else from
    the shapes alone, which counts every row or column as some group's (an upper bound)."""
    a_shape, b_shape = tuple(a.shape), tuple(b.shape)
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    # The grouped extent, and the product of the other two dimensions.
    if len(a_shape) == 2 and len(b_shape) == 3:
        extent, rest = a_shape[0], a_shape[1] * b_shape[2]
    elif len(a_shape) == 2 and len(b_shape) == 2:
        extent, rest = a_shape[1], a_shape[0] * b_shape[1]
    elif len(a_shape) == 3 and len(b_shape) == 2:
        extent, rest = b_shape[1], a_shape[1] * a_shape[2]
    else:
        return 0
    if isinstance(offs, torch.Tensor) and offs.numel() and offs.device.type != "meta":
        if not is_fake(offs):
            extent = min(extent, int(offs[-1]))
    return 2 * extent * rest
