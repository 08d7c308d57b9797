"""Small models the tracing and executor tests share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.step.job import Job


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.bn(self.inp(x))))


def repeated_batch_job(model: nn.Module, rows: int, features: int, steps: int) -> Job:
    """``model`` trained with SGD on one seeded batch of 4-class rows, ``steps`` times."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(rows, features, generator=g), torch.randint(0, 4, (rows,), generator=g))]
    return Job(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), data * steps)
