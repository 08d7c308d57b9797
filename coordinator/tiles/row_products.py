"""The result check's skinny products at memory speed: ``check_parts.rows_times_each``
as loops compiled by numba.

The check multiplies every row chunk of ``c`` and of each ``b`` block by a few secret
vectors (``c ρ``, ``b ρ``). BLAS runs a product with four columns far below memory
speed (it packs the large operand first, and its kernels are built for square
products); these loops read each row once, keep the vectors' sums and the row's sum of
squares (its norm, which the check also needs) in registers, and write a few numbers a
row. The sums are the same dot products in another order, which the check's rounding
model allows (``coordinator.tiles.honest_error``: any order of one chunk's sum).

The reference ``a (b ρ)`` (``verify._reference``) is a product with a few columns too,
per K block: four for a tile alone, a few dozen for a row of tiles or a stack checked
together. BLAS ran it far below the speed of a loop that keeps two rows' sums for four
columns in registers; each column's sums are the same whatever the other columns, so a
tile's reference is the same alone or made with its row's.

numba compiles them once a process first needs them (the coordinator: as its server
starts), in seconds, once: the compiled code is cached beside this file, and later
processes load it in well under a second. Wherever numba cannot be imported or compile
them, the check takes torch's products. One path a process for every block that lies in
one piece (all the check is given; a strided view would go to torch), but for the
reference of an ``a`` that lies transposed, which takes torch's product: the two round
differently in the last bits, so a tile checked twice with the same vectors (a stack
and the same tiles alone) would not get quite the same margins. Only reassociation and
fused multiply-adds are allowed to the compiler: infinities and NaNs pass through as in
torch's sums, for the check's non-finite verdicts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

log = logging.getLogger("cleave.coordinator")

_FLAGS = {"reassoc", "contract"}
_LOCK = threading.Lock()
_kernels: _Kernels | None = None
_tried = False


class _Kernels:
    """The compiled loops: rows of a matrix as it lies, rows of a matrix that lies
    transposed (a weight block, as sent), and the references ``a (b ρ)``."""

    def __init__(self, jit: Callable[..., Any]) -> None:
        @jit(fastmath=_FLAGS, cache=True, nogil=True)
        def rows(x, vt, out, norms, want_norms):  # type: ignore[no-untyped-def]
            # x [N, W] in order; out [V, N]: out[j, i] = x[i] . vt[j]; norms [N].
            count, width = x.shape
            vectors = vt.shape[0]
            zero = x.dtype.type(0)
            for i in range(count):
                squares = zero
                if vectors == 4:
                    s0 = zero
                    s1 = zero
                    s2 = zero
                    s3 = zero
                    for w in range(width):
                        e = x[i, w]
                        s0 += e * vt[0, w]
                        s1 += e * vt[1, w]
                        s2 += e * vt[2, w]
                        s3 += e * vt[3, w]
                        squares += e * e
                    out[0, i] = s0
                    out[1, i] = s1
                    out[2, i] = s2
                    out[3, i] = s3
                else:
                    for j in range(vectors):
                        total = zero
                        for w in range(width):
                            total += x[i, w] * vt[j, w]
                        out[j, i] = total
                    for w in range(width):
                        squares += x[i, w] * x[i, w]
                if want_norms:
                    norms[i] = np.sqrt(squares)

        @jit(fastmath=_FLAGS, cache=True, nogil=True)
        def stored_rows(st, vt, out, norms, want_norms, chunks, width):  # type: ignore[no-untyped-def]
            # st [B, cols, rows] in order: the transpose of x [B, rows, cols]. Row r of
            # x, chunk c, is out index (b * rows + r) * chunks + c, as for x in order.
            batch, _, rows = st.shape
            vectors = vt.shape[0]
            sums = np.zeros((vectors, rows), dtype=st.dtype)
            squares = np.zeros(rows, dtype=st.dtype)
            for b in range(batch):
                for c in range(chunks):
                    sums[:] = 0
                    squares[:] = 0
                    for w in range(width):
                        line = st[b, c * width + w]
                        for j in range(vectors):
                            weight = vt[j, w]
                            into = sums[j]
                            for r in range(rows):
                                into[r] += line[r] * weight
                        if want_norms:
                            for r in range(rows):
                                squares[r] += line[r] * line[r]
                    for r in range(rows):
                        at = (b * rows + r) * chunks + c
                        for j in range(vectors):
                            out[j, at] = sums[j, r]
                        if want_norms:
                            norms[at] = np.sqrt(squares[r])

        @jit(fastmath=_FLAGS, cache=True, nogil=True)
        def references(a, projected, block):  # type: ignore[no-untyped-def]
            # a [G, T, m, k] in order; projected [T, k, cols]: [G, T, m, cols] float64,
            # each block of K summed in a's dtype, the blocks added in float64 in K
            # order. Two rows at a time, four columns at a time, from the columns laid
            # out along K (a last partial group padded with zeros): each load of a
            # column's entry serves two rows. A row's sums are the same whatever its
            # neighbours (a last odd row is paired with itself) and the other columns.
            groups, batch, m, k = a.shape
            cols = projected.shape[2]
            padded = (cols + 3) // 4 * 4
            pt = np.zeros((batch, padded, k), dtype=a.dtype)
            for t in range(batch):
                for j in range(k):
                    for c in range(cols):
                        pt[t, c, j] = projected[t, j, c]
            out = np.empty((groups, batch, m, cols), dtype=np.float64)
            zero = a.dtype.type(0)
            for g in range(groups):
                for t in range(batch):
                    p = pt[t]
                    for i in range(0, m, 2):
                        two = i + 1 < m
                        row_a = a[g, t, i]
                        row_b = a[g, t, i + 1] if two else row_a
                        for c in range(0, padded, 4):
                            t0 = t1 = t2 = t3 = 0.0
                            u0 = u1 = u2 = u3 = 0.0
                            for start in range(0, k, block):
                                end = min(start + block, k)
                                # Slices, so the loop below is vectorised.
                                xa = row_a[start:end]
                                xb = row_b[start:end]
                                q0 = p[c, start:end]
                                q1 = p[c + 1, start:end]
                                q2 = p[c + 2, start:end]
                                q3 = p[c + 3, start:end]
                                s0 = s1 = s2 = s3 = zero
                                v0 = v1 = v2 = v3 = zero
                                for j in range(end - start):
                                    e = xa[j]
                                    f = xb[j]
                                    w0 = q0[j]
                                    w1 = q1[j]
                                    w2 = q2[j]
                                    w3 = q3[j]
                                    s0 += e * w0
                                    s1 += e * w1
                                    s2 += e * w2
                                    s3 += e * w3
                                    v0 += f * w0
                                    v1 += f * w1
                                    v2 += f * w2
                                    v3 += f * w3
                                t0 += np.float64(s0)
                                t1 += np.float64(s1)
                                t2 += np.float64(s2)
                                t3 += np.float64(s3)
                                u0 += np.float64(v0)
                                u1 += np.float64(v1)
                                u2 += np.float64(v2)
                                u3 += np.float64(v3)
                            sums = (t0, t1, t2, t3)
                            pair = (u0, u1, u2, u3)
                            for d in range(min(4, cols - c)):
                                out[g, t, i, c + d] = sums[d]
                                if two:
                                    out[g, t, i + 1, c + d] = pair[d]
            return out

        self._rows = rows
        self._stored_rows = stored_rows
        self._references = references

    def warm(self) -> None:
        """Compile (or load from the cache) each loop for the check's two work dtypes."""
        for dtype in (np.float32, np.float64):
            vt = np.ones((4, 2), dtype=dtype)
            out = np.empty((4, 2), dtype=dtype)
            norms = np.empty(2, dtype=dtype)
            self._rows(np.ones((2, 2), dtype=dtype), vt, out, norms, True)
            self._stored_rows(np.ones((1, 2, 1), dtype=dtype), vt, out, norms, True, 1, 2)
            self._references(np.ones((1, 1, 2, 2), dtype=dtype), np.ones((1, 2, 3), dtype), 1)

    def row_products(
        self,
        x: torch.Tensor,
        width: int,
        v_t: torch.Tensor,
        out: torch.Tensor,
        norms: torch.Tensor | None,
        transposed: bool,
    ) -> bool:
        """``rows_times_each`` of one ``x`` into ``out`` ``[V, rows]`` (and ``norms``),
        where ``x`` lies in order or transposed in one block of memory; False (nothing
        written) for any other layout or dtype."""
        dtype = v_t.dtype
        if x.dtype != dtype or dtype not in (torch.float32, torch.float64):
            return False
        if out.dtype != dtype or (norms is not None and norms.dtype != dtype):
            return False
        flat_norms = norms.numpy() if norms is not None else _NO_NORMS[dtype]
        if transposed:
            stored = x.detach().mT
            stored = stored.reshape(-1, stored.shape[-2], stored.shape[-1])
            if not stored.is_contiguous():
                return False
            chunks = x.shape[-1] // width
            self._stored_rows(
                stored.numpy(),
                v_t.numpy(),
                out.numpy(),
                flat_norms,
                norms is not None,
                chunks,
                width,
            )
            return True
        if not x.is_contiguous():
            return False
        rows = x.detach().reshape(-1, width).numpy()
        self._rows(rows, v_t.numpy(), out.numpy(), flat_norms, norms is not None)
        return True

    def reference(
        self, a: torch.Tensor, projected: torch.Tensor, k_blocks: int
    ) -> torch.Tensor | None:
        """``a (b ρ)`` in float64, ``[..., batch, m, cols]``, for ``a [..., batch, m, k]``
        in order and ``projected`` (``b ρ``) ``[batch, k, cols]`` of a's dtype: each of
        ``k_blocks`` blocks of K summed in that dtype, the blocks added in float64 in K
        order, as ``verify._reference`` does with torch's products. None (nothing done)
        for any other layout or dtype."""
        dtype = a.dtype
        if dtype not in (torch.float32, torch.float64) or projected.dtype != dtype:
            return None
        if not a.is_contiguous():
            return None
        *lead, batch, m, k = a.shape
        made = self._references(
            a.detach().reshape(-1, batch, m, k).numpy(),
            projected.detach().contiguous().numpy(),
            k // k_blocks,
        )
        return torch.from_numpy(made).view(*lead, batch, m, projected.shape[-1])


# What the loops are given for the norms where none are asked for (never written).
_NO_NORMS = {torch.float32: np.empty(1, np.float32), torch.float64: np.empty(1, np.float64)}


def kernels() -> _Kernels | None:
    """The compiled loops (compiled by the first call, which waits for them), or None
    wherever numba is missing or could not compile them."""
    global _tried, _kernels
    if _tried:
        return _kernels
    with _LOCK:
        if not _tried:
            _kernels = _compile()
            _tried = True
    return _kernels


def _compile() -> _Kernels | None:
    try:
        from numba import njit
    except ImportError:
        log.info("numba is not installed: the result check uses torch's products")
        return None
    try:
        compiled = _Kernels(njit)
        compiled.warm()
    except Exception:  # noqa: BLE001 - the check goes on with torch's products
        log.exception("compiling the result check's row products failed; torch's are used")
        return None
    return compiled
