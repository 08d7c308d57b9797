"""The memory tiles' products are written into, reused once each result has gone out.

A fresh tensor for every product is, at a product's size, mostly fresh memory from the
system: its pages are faulted in and zeroed by the kernel while the GEMM writes them, on
the compute thread, between its multiplies (docs/benchmarks.md, the tile path). A product
written into a buffer whose result was already sent costs only the GEMM. The compute
thread takes buffers; the connection's send loop gives each back once the result frame
that carried it has been written (its bytes were masked into the frame's own copy by
then). A buffer never given back (its tile was cancelled) is freed with its tensor.
"""

from __future__ import annotations

import math
import threading

import torch

KEPT = 4  # free buffers kept: a worker holds a few tiles at once (its window)
KEPT_BYTES = 64 << 20  # and at most this much memory in them: idle, it is the owner's


class ResultBuffers:
    """Free buffers for products, by dtype; thread-safe (one taker, one giver)."""

    def __init__(self, kept: int = KEPT, kept_bytes: int = KEPT_BYTES) -> None:
        self._kept = kept
        self._kept_bytes = kept_bytes
        self._free: list[torch.Tensor] = []  # 1-D, oldest first
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype``, contents undefined: the
        smallest free buffer that holds it and is at most twice its size (a small product
        would hold a large buffer's memory), or a new one."""
        size = math.prod(shape)
        with self._lock:
            fits = [
                i
                for i, t in enumerate(self._free)
                if t.dtype == dtype and size <= t.numel() <= 2 * size
            ]
            if fits:
                buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            else:
                buffer = torch.empty(size, dtype=dtype)
        return buffer[:size].view(shape)

    def give_back(self, product: torch.Tensor) -> None:
        """Nobody reads ``product`` any more (its result frame is written): its memory
        may hold a later product. Only a contiguous CPU tensor is kept, and only the
        latest ``kept`` of them, within ``kept_bytes`` in all."""
        if product.device.type != "cpu" or not product.is_contiguous() or not product.numel():
            return
        if product.untyped_storage().nbytes() > self._kept_bytes:
            return
        with self._lock:
            if any(t.data_ptr() == product.data_ptr() for t in self._free):
                return  # given back twice: kept once, or two products would share it
            self._free.append(product.reshape(-1))
            while len(self._free) > self._kept or self._bytes() > self._kept_bytes:
                self._free.pop(0)

    def _bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._free)
