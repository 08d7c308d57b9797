"""A GEMM operand sent as an image block and expanded by the receiver: convolution tiles.

A convolution is a GEMM over the patches of its input (im2col): each row of the patch
matrix is one output position of one image, each column one (channel, kernel row,
kernel column). That matrix repeats every input value up to kernel-size times, so
sending it would multiply the bytes on the wire by about that much. Instead a task may
carry the image block itself with an ``Unfold`` in its signed header, and the worker
expands it with ``torch.nn.functional.unfold``: a rearrangement of the bytes it was sent,
no code. From then on the tile is an ordinary ``mm`` tile, computed and checked exactly
like any other (the coordinator expands the same block the same way to check it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.errors import LimitExceeded, ProtocolError, TensorCodecError
from common.limits import WireLimits

UNFOLD_FIELD = "unfold"  # the task header's field
MAX_GEOMETRY = 1024  # largest kernel side, stride, padding or dilation a task may name


@dataclass(frozen=True)
class Unfold:
    """Operand ``operand`` ("a" or "b") of an mm task is an image block (N, C, H, W); the
    GEMM uses its patch matrix (N·Ho·Wo, C·kh·kw), rows image by image, columns channel
    by channel, as ``torch.nn.functional.unfold`` orders them."""

    operand: str
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]

    def __post_init__(self) -> None:
        if self.operand not in ("a", "b"):
            raise ValueError(f"Unfold.operand must be 'a' or 'b', not {self.operand!r}")

    @property
    def kernel_size(self) -> int:
        return self.kernel[0] * self.kernel[1]

    def positions(self, height: int, width: int) -> tuple[int, int]:
        """Output rows and columns of one image (each >= 1 for a valid geometry)."""
        return tuple(  # type: ignore[return-value]
            (size + 2 * p - d * (k - 1) - 1) // s + 1
            for size, k, s, p, d in zip(
                (height, width), self.kernel, self.stride, self.padding, self.dilation, strict=True
            )
        )

    def matrix_shape(self, image_shape: Sequence[int]) -> tuple[int, int]:
        n, c, h, w = image_shape
        ho, wo = self.positions(h, w)
        return n * ho * wo, c * self.kernel_size

    def expand(self, image: torch.Tensor) -> torch.Tensor:
        """The patch matrix of ``image``, contiguous."""
        n = image.shape[0]
        cols = torch.nn.functional.unfold(
            image, self.kernel, self.dilation, self.padding, self.stride
        )
        return cols.transpose(1, 2).reshape(n * cols.shape[2], cols.shape[1])

    def matrices(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The GEMM's operands: the image operand expanded, the other as it is."""
        return (self.expand(a), b) if self.operand == "a" else (a, self.expand(b))

    def to_header(self) -> dict[str, Any]:
        return {
            "operand": self.operand,
            "kernel": list(self.kernel),
            "stride": list(self.stride),
            "padding": list(self.padding),
            "dilation": list(self.dilation),
        }

    @classmethod
    def from_header(cls, h: Any) -> Unfold:
        if not isinstance(h, dict):
            raise ProtocolError(f'task: field "{UNFOLD_FIELD}" must be an object')
        operand = h.get("operand")
        if operand not in ("a", "b"):
            raise ProtocolError(f'task: "{UNFOLD_FIELD}.operand" must be "a" or "b"')

        def pair(name: str, lo: int) -> tuple[int, int]:
            value = h.get(name)
            if (
                not isinstance(value, list)
                or len(value) != 2
                or not all(type(v) is int and lo <= v <= MAX_GEOMETRY for v in value)
            ):
                raise ProtocolError(
                    f'task: "{UNFOLD_FIELD}.{name}" must be two integers in {lo}..{MAX_GEOMETRY}'
                )
            return value[0], value[1]

        return cls(
            operand=operand,
            kernel=pair("kernel", 1),
            stride=pair("stride", 1),
            padding=pair("padding", 0),
            dilation=pair("dilation", 1),
        )

    def check_image(self, image: torch.Tensor, limits: WireLimits) -> tuple[int, int]:
        """The patch matrix's shape, after checking the image makes a valid one."""
        if image.dim() != 4 or min(image.shape[1:]) < 1:
            raise TensorCodecError(
                "an unfolded operand must be an image block (N, C, H, W) with C, H, W >= 1, "
                f"got {list(image.shape)}"
            )
        if min(self.positions(image.shape[2], image.shape[3])) < 1:
            raise TensorCodecError(
                f"kernel {list(self.kernel)} (dilation {list(self.dilation)}, padding "
                f"{list(self.padding)}) does not fit an image of {list(image.shape[2:])}"
            )
        rows, cols = self.matrix_shape(image.shape)
        if rows * cols > limits.max_tensor_elements:
            raise LimitExceeded(
                f"the unfolded operand of {rows}x{cols} elements exceeds "
                f"max_tensor_elements={limits.max_tensor_elements}"
            )
        return rows, cols
