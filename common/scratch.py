"""Buffers reused from call to call for a hot path's temporaries.

A fresh tensor of a block's size is fresh memory: its pages are faulted in and zeroed
when first written, which can cost as much as the work that fills them (and the
coordinator may hand its free heap back between steps). A ``Scratch`` keeps one buffer per key,
grown when a larger one is asked for; what it hands out is valid until the next
``take`` of the same key. Not thread-safe: one per thread.
"""

from __future__ import annotations

import math

import torch


class Scratch:
    def __init__(self) -> None:
        self._buffers: dict[object, torch.Tensor] = {}

    def take(self, key: object, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` (contiguous, contents undefined) in the
        buffer kept under ``key``."""
        size = math.prod(shape)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < size:
            buffer = self._buffers[key] = torch.empty(size, dtype=dtype)
        return buffer[:size].view(shape)
