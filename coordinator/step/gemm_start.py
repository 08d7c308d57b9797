"""How a GEMM's operands are handed to an offload: dense real ones as they are, complex
ones as one real GEMM, sparse ones not at all (a sparse adjacency matrix in a graph
network: tiles carry dense blocks; such a product runs here).

Workers multiply real dtypes only.
(a_r + i a_i)(b_r + i b_i) = (a_r b_r - a_i b_i) + i (a_r b_i + a_i b_r). Stacking a's
parts by rows and b's by columns, [a_r; a_i] @ [b_r | b_i] holds all four products in
one real GEMM whose operands are the complex operands' own bytes; its result is twice
the complex product's size, and the coordinator adds its quarters. That GEMM does the
complex product's real work (four real products per complex one), and its tiles are
checked like any other real GEMM's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from coordinator.step.executor import GemmDone, GemmOffload

_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def start_gemm(
    offload: GemmOffload, name: str, op: str, a: torch.Tensor, b: torch.Tensor, done: GemmDone
) -> int:
    """``offload.start`` for ``a @ b``, complex operands as one real GEMM. Returns the
    FLOPs handed out in the complex GEMM's own count (2·m·n·k per product, as the
    step's tally counts it); 0: nothing started."""
    if a.layout != torch.strided or b.layout != torch.strided:
        return 0
    if not (a.is_complex() or b.is_complex()):
        return offload.start(name, op, a, b, done)
    if a.dtype != b.dtype or a.dtype not in _REAL:
        return 0
    m, n = a.shape[-2], b.shape[-1]
    # Autograd multiplies by conjugates (a.mH) as views with the conjugate bit set.
    a, b = a.resolve_conj(), b.resolve_conj()
    stacked_a = torch.cat((a.real, a.imag), dim=-2)  # (.., 2m, k)
    stacked_b = torch.cat((b.real, b.imag), dim=-1)  # (.., k, 2n)

    def combine(value: torch.Tensor | BaseException) -> None:
        if isinstance(value, BaseException):
            done(value)
            return
        top, bottom = value[..., :m, :], value[..., m:, :]
        real = top[..., :n] - bottom[..., n:]
        imag = top[..., n:] + bottom[..., :n]
        done(torch.complex(real, imag))

    return offload.start(name, op, stacked_a, stacked_b, combine) // 4
