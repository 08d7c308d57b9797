"""Models written the way widely used libraries write them, served through ``--job``.

Each factory builds the same job from the same seed every time, so a distributed run and
``train_locally`` start from equal weights and see equal batches:

- ``make_sdpa_job``: a pre-norm transformer whose attention is
  ``F.scaled_dot_product_attention`` (the fused kernel torch picks on CPU), sequence 256;
- ``make_cnn_job``: a small ResNet-style CNN: convolutions (strided, grouped, 1x1),
  batch norm, max pooling, a residual add, global average pooling;
- ``make_data_dependent_job``: a padded-sequence model whose forward decides in Python
  on the data (``.any()`` on the padding, ``.item()`` for the longest sequence), as
  library mask helpers do, and whose loss divides by ``.item()`` of the token count.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.step.job import Job

VOCAB = 64


# ---- transformer with fused attention ----------------------------------------------------


class SdpaAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SdpaAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class SdpaTransformer(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, layers: int = 2, seq: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _token_batches(batch: int, seq: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        # A learnable sequence: each token is the previous one plus a per-row step.
        start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
        step = torch.randint(1, 4, (batch, 1), generator=gen)
        seqs = (start + step * torch.arange(seq + 1)) % VOCAB
        yield seqs[:, :-1], seqs[:, 1:]


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def make_sdpa_job(seq: int = 256, batch: int = 4) -> Job:
    torch.manual_seed(0)
    model = SdpaTransformer(seq=seq)
    return Job(
        model=model,
        loss_fn=_lm_loss,
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
        batches=_token_batches(batch, seq, seed=1),
        name="sdpa_transformer",
    )


# ---- a small CNN -------------------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self, c: int, groups: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False, groups=groups)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10, groups: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU()
        )
        self.block1 = Residual(32)
        self.down = nn.Sequential(
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU()
        )
        self.pool = nn.MaxPool2d(2)
        self.block2 = Residual(64, groups=groups)
        self.mix = nn.Conv2d(64, 64, 1)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.down(self.block1(self.stem(x))))
        x = F.relu(self.mix(self.block2(x)))
        return self.fc(x.mean(dim=(2, 3)))


def _image_batches(batch: int, size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        labels = torch.randint(0, 10, (batch,), generator=gen)
        images = torch.randn(batch, 3, size, size, generator=gen)
        # The class shows as a brighter channel-and-quadrant pattern: learnable.
        images[torch.arange(batch), labels % 3, : size // 2] += 1.0 + labels.view(-1, 1, 1) / 10
        yield images, labels


def make_cnn_job(batch: int = 16, size: int = 32, groups: int = 2) -> Job:
    torch.manual_seed(0)
    model = SmallCNN(groups=groups)
    return Job(
        model=model,
        loss_fn=F.cross_entropy,
        # A larger step makes this model chaotic: plain torch at 1 and at 2 threads then
        # disagrees by more than 1e-5 within 10 steps, and so would any two kernels.
        optimizer=torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
        batches=_image_batches(batch, size, seed=2),
        name="small_cnn",
    )


# ---- data-dependent Python in the forward and the loss -----------------------------------

PAD = 0


class PaddedTransformer(nn.Module):
    """A padded-batch encoder in the style of library mask helpers: the mask is built only
    when the batch has padding (``.any()``) and the batch is cut to its longest sequence
    (``.item()``), decisions make_fx cannot take on a traced tensor."""

    def __init__(self, d: int = 64, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.block = Block(d, heads)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        longest = int((tokens != PAD).sum(dim=1).max().item())
        tokens = tokens[:, :longest]
        mask = None
        if (tokens == PAD).any():
            keep = tokens != PAD
            mask = keep[:, None, None, :] & keep[:, None, :, None]
            mask = mask | torch.eye(longest, dtype=torch.bool)  # no row fully masked
        x = self.embed(tokens) + self.pos[:longest]
        return self.head(self.block(x, mask))


def _padded_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    targets = targets[:, : logits.shape[1]]
    real = targets != PAD
    per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (per_token * real).sum() / max(1, int(real.sum().item()))


def _padded_batches(batch: int, seq: int, seed: int) -> Iterator[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=gen)
        tokens = torch.randint(1, VOCAB, (batch, seq + 1), generator=gen)
        tokens[torch.arange(seq + 1) >= lengths[:, None] + 1] = PAD
        yield tokens[:, :-1].clone(), tokens[:, 1:].clone()


def make_data_dependent_job(batch: int = 8, seq: int = 64) -> Job:
    torch.manual_seed(0)
    model = PaddedTransformer(seq=seq)
    return Job(
        model=model,
        loss_fn=_padded_loss,
        optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
        batches=_padded_batches(batch, seq, seed=3),
        name="padded_transformer",
    )
