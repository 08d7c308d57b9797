"""Small models the tracing and executor tests share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.bn(self.inp(x))))
