"""Tile arithmetic with torch: the only place the worker touches a GEMM.

Operands arrive as read-only views of the received frame (see ``common.tensors``):
nothing here may write into them, so every op produces a fresh output tensor.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from client_app.result_buffers import ResultBuffers
from common.ops import TILE_OPS, TileOp
from common.scratch import Scratch
from common.tensors import stored_layout


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's marketing name where the OS tells it, else the best platform guess."""
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass  # not Linux: fall through to platform's answer
    return platform.processor() or platform.machine() or "unknown CPU"


def pin_full_precision() -> None:
    """Make every backend compute fp32 tiles at full fp32 and accumulate bf16/fp16 tiles
    in fp32: what the coordinator's check models as honest rounding.

    Left to their defaults some backends trade precision for speed: TF32 on NVIDIA GPUs
    (10 mantissa bits, as coarse as fp16's), bf16 for fp32 matmuls on CPUs with AMX once
    ``torch.set_float32_matmul_precision("medium")`` has been called, reduced-precision
    reductions in cuBLAS. A worker that returned such products would fail the check. It
    also keeps subnormal numbers (no flush to zero), which the check's model assumes.
    """
    if hasattr(torch.backends, "fp32_precision"):
        # torch >= 2.9 sets precision per backend; mixing this with the older switches
        # below makes torch raise, so only one of the two is used.
        torch.backends.fp32_precision = "ieee"
        backends: tuple[Any, ...] = (
            torch.backends.cuda.matmul,
            torch.backends.cudnn,
            torch.backends.mkldnn,
            torch.backends.mkldnn.matmul,  # type: ignore[attr-defined]
        )
        for backend in backends:
            backend.fp32_precision = "ieee"
    else:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.set_flush_denormal(False)


class TileComputer:
    """Computes ``a @ b`` tiles on one device under the owner's thread cap.

    Call ``compute`` from one dedicated thread: torch's intra-op thread count is
    applied on that thread (OpenMP keeps it per thread), which is also what lets
    ``threads`` change while the worker runs.
    """

    def __init__(
        self,
        threads: int,
        use_gpu: bool,
        *,
        cuda_available: Callable[[], bool] = torch.cuda.is_available,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, not {threads}")
        self.threads = threads
        self.device = torch.device("cuda" if use_gpu and cuda_available() else "cpu")
        self._scratch = Scratch()
        # What products are written into (``give_back`` returns one once sent).
        self.results = ResultBuffers()
        pin_full_precision()

    @property
    def device_name(self) -> str:
        if self.device.type == "cuda":
            return str(torch.cuda.get_device_name(self.device))
        return cpu_model_name()

    def apply_thread_cap(self) -> None:
        """Make torch on the calling thread use at most ``threads`` intra-op threads."""
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` for op "mm" (2-D) or "bmm" (3-D), as a contiguous CPU tensor."""
        if op not in TILE_OPS:
            raise ValueError(f"op {op!r} is not one of {TILE_OPS}")
        ndim = 2 if op == TileOp.MM else 3
        # matmul would broadcast other ranks; a tile is exactly one GEMM or batched GEMM.
        if a.dim() != ndim or b.dim() != ndim:
            raise ValueError(f"{op} needs {ndim}-D operands, got {list(a.shape)}, {list(b.shape)}")
        self.apply_thread_cap()
        if self.device.type != "cpu":
            a = a.to(self.device)
            b = b.to(self.device)
        else:
            if a.element_size() == 2:
                a, b = self._aligned(0, a), self._aligned(1, b)
            if _multipliable(op, a, b):  # else torch raises its own error below
                out = self.results.take((*a.shape[:-1], b.shape[-1]), a.dtype)
                return torch.mm(a, b, out=out) if op == TileOp.MM else torch.bmm(a, b, out=out)
        # A GPU's product (copied out to fresh memory), or torch's own error for operands
        # that do not multiply; the read-only operands are only read.
        c = torch.matmul(a, b) if op == TileOp.MM else torch.bmm(a, b)
        return c.cpu().contiguous()

    def give_back(self, c: torch.Tensor) -> None:
        """``c`` (a product ``compute`` returned) is no longer read: its result frame is
        written. Its memory holds a later product (on a GPU, products are copied out to
        fresh memory: none is kept)."""
        if self.device.type == "cpu":
            self.results.give_back(c)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _aligned(self, slot: int, t: torch.Tensor) -> torch.Tensor:
        """``t``, or a 64-byte-aligned copy of it when it is misaligned.

        Operands are views of the received frame, whose alignment Python's allocator
        decides. bf16/fp16 CPU kernels (oneDNN, AMX) run ~2x slower on misaligned
        operands; fp32 kernels measured no difference, so only 2-byte types are copied.
        The copies go into buffers reused from tile to tile (``Scratch``): fresh ones
        would pay a page fault per 4 KiB, which cost as much as the copy itself.
        """
        if t.data_ptr() % KERNEL_ALIGN == 0:
            return t
        # A transposed operand is copied in the order its bytes lie, and stays transposed.
        stored, transposed = stored_layout(t)
        copy = self._scratch.take(slot, stored.shape, t.dtype).copy_(stored)
        return copy.mT if transposed else copy


KERNEL_ALIGN = 64


def _multipliable(op: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (of the op's rank) have one dtype and matching dims: an
    ``out=`` of the product's shape is then exactly what torch would allocate."""
    if a.dtype != b.dtype or a.shape[-1] != b.shape[-2]:
        return False
    return op == TileOp.MM or a.shape[0] == b.shape[0]
