"""Tiles for the result check's calibration and its tests.

Three catalogues, used by ``bench/calibrate_verify.py``, the check's unit tests and the
cheating worker of the end-to-end tests:

- ``DISTRIBUTIONS``: operand values met in training (weights, activations after a
  ReLU, softmax probabilities, rows of very different scale, outliers, magnitudes near
  the subnormal range, gradients whose squares underflow, exact zeros, repeated rows,
  sums that cancel);
- ``honest_kernels``: every way an honest worker may compute a tile (torch at one and
  at all threads, ``addmm``/``baddbmm``, transposed and strided operands, float64
  rounded back, numpy's own BLAS, a naive recursive sum, CUDA with TF32 off);
- ``CHEATS``: what a dishonest worker may return instead (half-precision and TF32
  products, a tiny uniform scale, a few wrong entries, half of K, another tile's
  result, zeros, a transposed operand).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from client_app.compute import pin_full_precision

Shape = tuple[int | None, int, int, int]  # (batch or None, m, k, n)


def _lead(shape: Shape) -> tuple[int, ...]:
    return () if shape[0] is None else (shape[0],)


def _gaussian(shape: Shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    _, m, k, n = shape
    return torch.randn(*_lead(shape), m, k, generator=g), torch.randn(
        *_lead(shape), k, n, generator=g
    )


def _uniform(shape: Shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _gaussian(shape, g)
    return torch.rand(a.shape, generator=g) * 2 - 1, torch.rand(b.shape, generator=g) * 2 - 1


def _post_relu(shape: Shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _gaussian(shape, g)
    return a.relu_(), b  # activations after a ReLU times weights


def _nonnegative(shape: Shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _gaussian(shape, g)
    # Softmax-like probabilities times positive values: every partial sum grows.
    return torch.rand(a.shape, generator=g), torch.rand(b.shape, generator=g)


def _row_scales(shape: Shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _gaussian(shape, g)
    rows = 10.0 ** (torch.rand(*a.shape[:-1], 1, generator=g) * 6 - 3)  # 1e-3 .. 1e3
    cols = 10.0 ** (torch.rand(*b.shape[:-2], 1, b.shape[-1], generator=g) * 6 - 3)
    inner = 10.0 ** (torch.rand(*b.shape[:-2], b.shape[-2], 1, generator=g) * 2 - 1)
    return a * rows, b * cols * inner


def _outliers(shape: Shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _gaussian(shape, g)
    for t in (a, b):
        mask = torch.rand(t.shape, generator=g) < 1e-3
        t[mask] *= 1000.0
    return a, b


def _tiny(shape: Shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _gaussian(shape, g)
    return a * 1e-19, b * 1e-19  # products near fp32's smallest normal (1.2e-38)


def _tiny_gradients(shape: Shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _gaussian(shape, g)
    # The gradients of a model that fits its batch (a softmax sure of every token) times
    # weights: rows from 1e-18 down to 1e-33, whose fp32 squares are subnormal or zero,
    # while their products with the weights are normal numbers.
    rows = 10.0 ** (torch.rand(*a.shape[:-1], 1, generator=g) * -15 - 18)
    return a * rows, b


def _zeros(shape: Shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _gaussian(shape, g)
    a[torch.rand(a.shape, generator=g) < 0.5] = 0.0
    b[torch.rand(b.shape, generator=g) < 0.5] = 0.0
    a[..., :: max(1, a.shape[-2] // 4) + 3, :] = 0.0  # whole zero rows of c
    b[..., :, :: max(1, b.shape[-1] // 4) + 3] = 0.0  # and whole zero columns
    return a, b


def _repeated_rows(shape: Shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _gaussian(shape, g)
    # A batch padded with one token, or the same sample many times: rows of a repeat,
    # and honest rounding repeats with them (it is the same computation).
    pick = torch.randint(0, min(4, a.shape[-2]), (a.shape[-2],), generator=g)
    return a[..., pick, :].contiguous(), b


def _cancelling(shape: Shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _gaussian(shape, g)
    # Rows of a share a large common value and b's columns sum to zero (as the rows of
    # a softmax's gradient do): c is far smaller than the terms it is made of.
    a = 1.0 + 0.01 * a
    b = b - b.mean(dim=-2, keepdim=True)
    return a, b


DISTRIBUTIONS: dict[str, Callable[[Shape, torch.Generator], tuple[torch.Tensor, torch.Tensor]]] = {
    "gaussian": _gaussian,
    "uniform": _uniform,
    "post-ReLU": _post_relu,
    "non-negative": _nonnegative,
    "row scales": _row_scales,
    "outliers": _outliers,
    "tiny": _tiny,
    "zeros": _zeros,
    "repeated rows": _repeated_rows,
    "cancelling": _cancelling,
    "tiny gradients": _tiny_gradients,
}


def operands(
    distribution: str, shape: Shape, dtype: torch.dtype, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands of ``distribution`` in ``dtype``. fp16 operands are scaled by a power of
    two so that no honest product overflows (65504), and "tiny" ones sit near fp16's
    own subnormal range instead of fp32's."""
    a, b = DISTRIBUTIONS[distribution](shape, g)
    if dtype == torch.float16:
        if distribution == "tiny":
            a, b = a * 2e15, b * 2e15  # products ~4e-8: fp16 subnormals
        else:
            bound = shape[2] * float(a.abs().max()) * float(b.abs().max())
            if bound > 1000.0:
                scale = 2.0 ** math.floor(math.log2(math.sqrt(1000.0 / bound)))
                a, b = a * scale, b * scale
    return a.to(dtype), b.to(dtype)


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The worker's own product: ``TileComputer.compute`` runs exactly this."""
    return torch.matmul(a, b) if a.dim() == 2 else torch.bmm(a, b)


# ---- honest kernels ---------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    name: str
    multiply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    applies: Callable[[Shape, torch.dtype], bool] = lambda shape, dtype: True


def _with_threads(threads: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def multiply(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return product(a, b)
        finally:
            torch.set_num_threads(before)

    return multiply


def _addmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dim() == 2:
        return torch.addmm(torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype), a, b)
    return torch.baddbmm(torch.zeros(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype), a, b)


def _column_major(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Operands stored transposed (a column-major view), as autograd's backward passes
    # hand them to the kernel.
    return product(a.mT.contiguous().mT, b.mT.contiguous().mT)


def _strided(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    wide_a = torch.zeros(*a.shape[:-1], 2 * a.shape[-1], dtype=a.dtype)
    wide_b = torch.zeros(*b.shape[:-1], 2 * b.shape[-1], dtype=b.dtype)
    wide_a[..., ::2] = a
    wide_b[..., ::2] = b
    return product(wide_a[..., ::2], wide_b[..., ::2])


def _float64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return product(a.double(), b.double()).to(a.dtype)


def _numpy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.matmul(a.numpy(), b.numpy()))


def _recursive(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # The naive kernel: products rounded to fp32, then added one after another in K
    # order (the longest chain there is), rounded once to the tile's dtype.
    terms = a.float().unsqueeze(-1) * b.float().unsqueeze(-3)  # [.., m, k, n]
    return torch.cumsum(terms, dim=-2).select(-2, -1).to(a.dtype)


def _cuda(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    pin_full_precision()  # TF32 off, as the worker runs
    return product(a.cuda(), b.cuda()).cpu()


def honest_kernels() -> list[Kernel]:
    """The kernels an honest worker may multiply with, on this machine."""
    threads = torch.get_num_threads()
    fp32 = lambda shape, dtype: dtype == torch.float32  # noqa: E731
    kernels = [
        Kernel("torch, 1 thread", _with_threads(1)),
        Kernel(f"torch, {threads} threads", _with_threads(threads)),
        Kernel("addmm / baddbmm", _addmm),
        Kernel("column-major operands", _column_major),
        Kernel("strided operands", _strided),
        Kernel("float64, rounded", _float64),
        Kernel("numpy (its own BLAS)", _numpy, fp32),
        Kernel(
            "recursive sum",
            _recursive,
            lambda shape, dtype: (shape[0] or 1) * shape[1] * shape[2] * shape[3] <= 1 << 23,
        ),
    ]
    if torch.cuda.is_available():
        kernels.append(Kernel("CUDA, TF32 off", _cuda))
    return kernels


# ---- cheats -----------------------------------------------------------------------------


def tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to TF32's 10 mantissa bits (to nearest, ties to even), as tensor
    cores read fp32 operands when TF32 is on."""
    bits = x.float().contiguous().view(torch.int32)
    rounding = 0xFFF + ((bits >> 13) & 1)
    return ((bits + rounding) & ~0x1FFF).view(torch.float32)


def _rounded_operands(
    to: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor
]:
    def cheat(a, b, c, other, g):  # type: ignore[no-untyped-def]
        return product(to(a.float()), to(b.float())).to(c.dtype)

    return cheat


def _scaled(factor: float):  # type: ignore[no-untyped-def]
    def cheat(a, b, c, other, g):  # type: ignore[no-untyped-def]
        return c * (1.0 + factor)

    return cheat


def entries_off(c: torch.Tensor, count: int, fraction: float, g: torch.Generator) -> torch.Tensor:
    """``c`` with ``count`` random entries moved by ``fraction`` of max |c|, either way."""
    bad = c.clone()
    flat = bad.view(-1)
    where = torch.randperm(flat.numel(), generator=g)[:count]
    signs = torch.randint(0, 2, (count,), generator=g).to(c.dtype) * 2 - 1
    flat[where] += signs * fraction * float(c.abs().max())
    return bad


def _one_entry(fraction: float):  # type: ignore[no-untyped-def]
    def cheat(a, b, c, other, g):  # type: ignore[no-untyped-def]
        return entries_off(c, 1, fraction, g)

    return cheat


def _sparse(a, b, c, other, g):  # type: ignore[no-untyped-def]
    return entries_off(c, max(1, math.ceil(1e-3 * c.numel())), 1e-3, g)


def _truncated(a, b, c, other, g):  # type: ignore[no-untyped-def]
    half = a.shape[-1] // 2
    if half == 0:
        return torch.zeros_like(c)
    return product(a[..., :half], b[..., :half, :])


def _replayed(a, b, c, other, g):  # type: ignore[no-untyped-def]
    return other


def _zeros_result(a, b, c, other, g):  # type: ignore[no-untyped-def]
    return torch.zeros_like(c)


def _transposed(a, b, c, other, g):  # type: ignore[no-untyped-def]
    if a.shape[-1] == b.shape[-1]:
        return product(a, b.mT)  # b read as if stored the other way round
    if a.shape[-2] == a.shape[-1]:
        return product(a.mT, b)
    return product(a, b.flip(-2))  # no square operand: b's rows in reverse order


Cheat = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor
]
"""A dishonest result: ``cheat(a, b, honest_c, other_tiles_c, generator)``."""

CHEATS: dict[str, Cheat] = {
    "fp16 operands": _rounded_operands(lambda x: x.half().float()),
    "bf16 operands": _rounded_operands(lambda x: x.bfloat16().float()),
    "TF32 operands": _rounded_operands(tf32),
    "scale 1+1e-4": _scaled(1e-4),
    "1 entry +-1e-3 max": _one_entry(1e-3),
    "0.1% entries +-1e-3 max": _sparse,
    "half of K": _truncated,
    "replayed tile": _replayed,
    "zeros": _zeros_result,
    "transposed operand": _transposed,
}

SCALES = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 3e-6, 1e-6, 3e-7, 1e-7)
ENTRY_FRACTIONS = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 3e-6, 1e-6)


def scale_cheat(factor: float) -> Cheat:
    return _scaled(factor)


def entry_cheat(fraction: float) -> Cheat:
    return _one_entry(fraction)


def shapes_label(shape: Shape) -> str:
    batch, m, k, n = shape
    return ("" if batch is None else f"{batch} x ") + f"{m} x {k} x {n}"
