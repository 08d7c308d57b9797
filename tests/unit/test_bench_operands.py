"""bench_step.py's count of a step's GEMM operand bytes: each time a GEMM reads one, and
the distinct contents among them (a transposed view is the matrix it views)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_step import _GemmOperands  # noqa: E402

FP32 = 4


def test_a_tensor_two_gemms_read_counts_twice_as_read_and_once_as_distinct() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)  # no gradient: the first layer has no input-gradient GEMM
    operands = _GemmOperands()
    with operands:
        model(x).square().sum().backward()
    x_, w1, h, w2, dy2, dh = 5 * 8, 16 * 8, 5 * 16, 4 * 16, 5 * 4, 5 * 16
    # Forward: x W1ᵀ, h W2ᵀ (their biases are not factors). Backward: dY2 W2 (the hidden
    # layer's gradient), dY2ᵀ h and dHᵀ x (the weights' gradients).
    read = (x_ + w1) + (h + w2) + (dy2 + w2) + (dy2 + h) + (dh + x_)
    assert operands.read == read * FP32
    # Each of x, h, W2 and dY2 is read by two GEMMs; W1 and dH by one.
    assert sum(operands.distinct.values()) == (x_ + w1 + h + w2 + dy2 + dh) * FP32
