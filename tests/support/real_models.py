"""Models written the way widely used libraries write them, served through ``--job``.

Each factory builds the same job from the same seed every time, so a distributed run and
``train_locally`` start from equal weights and see equal batches:

- ``make_sdpa_job``: a pre-norm transformer whose attention is
  ``F.scaled_dot_product_attention`` (the fused kernel torch picks on CPU), sequence 256;
- ``make_cnn_job``: a small ResNet-style CNN: convolutions (strided, grouped, 1x1),
  batch norm, max pooling, a residual add, global average pooling;
- ``make_data_dependent_job``: a padded-sequence model whose forward decides in Python
  on the data (``.any()`` on the padding, ``.item()`` for the longest sequence), as
  library mask helpers do, and whose loss divides by ``.item()`` of the token count;
- ``make_moe_job``: a mixture-of-experts transformer (top-2 routing over 4 experts), its
  experts either stacked weights run with ``torch._grouped_mm`` (transformers' default
  experts implementation) or a Python loop over per-expert ``nn.Linear`` layers that skips
  experts no token chose (its eager one);
- ``make_resnext_job``: ResNeXt bottleneck blocks (1x1, grouped 3x3 with 16 channels a
  group, 1x1, batch norm, residual);
- ``make_convnext_job``: ConvNeXt blocks (depthwise 7x7, LayerNorm over channels, an
  inverted bottleneck MLP, layer scale, stochastic depth) with a patchify stem and a
  downsampling layer;
- ``make_tied_lm_job``: a language model whose output head is its token embedding (GPT-2's
  tying), asked for the token it is given: it fits from the first step, and its
  gradients are so small that their squares underflow fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    def __init__(
        self,
        d: int = 64,
        heads: int = 4,
        layers: int = 2,
        seq: int = 256,
        block: Callable[[], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList((block or (lambda: Block(d, heads)))() for _ in range(layers))
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


class Decoder(nn.Module):
    """A GAN generator's or a VAE decoder's upsampling, with a 1-D branch as a vocoder
    upsamples: transposed convolutions, strided, with output_padding, grouped."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32 * 4 * 4)
        self.up1 = nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.up2 = nn.ConvTranspose2d(16, 16, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.wave = nn.ConvTranspose1d(16, 8, 8, stride=4, padding=2)
        self.to_rgb = nn.Conv2d(16, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.up1(self.fc(z).view(-1, 32, 4, 4))))
        h = F.relu(self.up2(h))  # (N, 16, 16, 16)
        wave = self.wave(h.mean(dim=2))  # (N, 8, 64)
        return torch.tanh(self.to_rgb(h)).mean(dim=1) + wave.mean(dim=(1, 2)).view(-1, 1, 1)


def make_decoder_job(batch: int = 4) -> Job:
    torch.manual_seed(0)
    model = Decoder()
    gen = torch.Generator().manual_seed(4)
    data = [
        (torch.randn(batch, 16, generator=gen), torch.rand(batch, 16, 16, generator=gen))
        for _ in range(4)
    ]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return Job(model=model, loss_fn=F.mse_loss, optimizer=opt, batches=data, name="decoder")


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


# ---- mixture of experts ------------------------------------------------------------------


class GroupedExperts(nn.Module):
    """Experts as stacked weights, run as transformers' default experts implementation
    runs them: the (token, expert) pairs sorted by expert, one grouped GEMM a projection."""

    def __init__(self, d: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.experts = experts
        self.w_in = nn.Parameter(torch.randn(experts, d, hidden) * d**-0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, d) * hidden**-0.5)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        top_k = chosen.shape[1]
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        tokens = order // top_k
        per_expert = torch.histc(flat.float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = per_expert.cumsum(0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x[tokens], self.w_in, offs=offs))
        y = torch._grouped_mm(h, self.w_out, offs=offs) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, tokens, y)


class LoopExperts(nn.Module):
    """Experts as a Python loop, as transformers' eager experts implementation: experts
    that no token chose are skipped, a decision on the data."""

    def __init__(self, d: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden, bias=False), nn.SiLU(), nn.Linear(hidden, d))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class MoeBlock(nn.Module):
    def __init__(self, d: int, heads: int, experts: int, top_k: int, grouped: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SdpaAttention(d, heads)
        self.router = nn.Linear(d, experts, bias=False)
        kind = GroupedExperts if grouped else LoopExperts
        self.experts = kind(d, 2 * d, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        b, t, d = x.shape
        h = self.norm2(x).reshape(b * t, d)
        weights, chosen = self.router(h).softmax(dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return x + self.experts(h, chosen, weights).reshape(b, t, d)


def make_moe_job(grouped: bool = True, seq: int = 64, batch: int = 4) -> Job:
    torch.manual_seed(0)
    # The pre-norm transformer above, each block's MLP a mixture of 4 experts, top-2.
    model = SdpaTransformer(seq=seq, block=lambda: MoeBlock(64, 4, 4, 2, grouped))
    return Job(
        model=model,
        loss_fn=_lm_loss,
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
        batches=_token_batches(batch, seq, seed=4),
        name="moe_grouped" if grouped else "moe_loop",
    )


def make_moe_loop_job(seq: int = 64, batch: int = 4) -> Job:
    return make_moe_job(grouped=False, seq=seq, batch=batch)


# ---- grouped and depthwise convolutions --------------------------------------------------


class Bottleneck(nn.Module):
    """A ResNeXt block: 1x1 down, a grouped 3x3, 1x1 up, each with batch norm."""

    def __init__(self, c: int, width: int, groups: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(c, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.grouped = nn.Conv2d(width, width, 3, padding=1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.expand = nn.Conv2d(width, c, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.reduce(x)))
        y = F.relu(self.bn2(self.grouped(y)))
        return F.relu(x + self.bn3(self.expand(y)))


class ResNeXt(nn.Module):
    def __init__(self, c: int = 64, width: int = 64, groups: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))
        self.blocks = nn.Sequential(Bottleneck(c, width, groups), Bottleneck(c, width, groups))
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(F.relu(self.stem(x))).mean(dim=(2, 3)))


def make_resnext_job(batch: int = 8, size: int = 16) -> Job:
    torch.manual_seed(0)
    model = ResNeXt()
    return Job(
        model=model,
        loss_fn=F.cross_entropy,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
        batches=_image_batches(batch, size, seed=5),
        name="resnext",
    )


class ChannelsLastNorm(nn.LayerNorm):
    """LayerNorm over the channels of an (N, C, H, W) image, as ConvNeXt's downsampling."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, c: int, drop_path: float) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c))
        self.scale = nn.Parameter(torch.full((c,), 0.1))
        self.drop_path = drop_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.depthwise(x).permute(0, 2, 3, 1)
        y = (self.scale * self.mlp(self.norm(y))).permute(0, 3, 1, 2)
        if self.training and self.drop_path > 0:  # stochastic depth, per sample
            keep = 1 - self.drop_path
            y = y * torch.empty(y.shape[0], 1, 1, 1).bernoulli_(keep) / keep
        return x + y


class ConvNeXt(nn.Module):
    def __init__(self, dims: tuple[int, int] = (64, 128), classes: int = 10) -> None:
        super().__init__()
        c0, c1 = dims
        self.stem = nn.Sequential(nn.Conv2d(3, c0, 4, stride=4), ChannelsLastNorm(c0, eps=1e-6))
        self.stage1 = nn.Sequential(ConvNeXtBlock(c0, 0.0), ConvNeXtBlock(c0, 0.1))
        self.down = nn.Sequential(ChannelsLastNorm(c0, eps=1e-6), nn.Conv2d(c0, c1, 2, stride=2))
        self.stage2 = nn.Sequential(ConvNeXtBlock(c1, 0.1), ConvNeXtBlock(c1, 0.2))
        self.norm = nn.LayerNorm(c1, eps=1e-6)
        self.head = nn.Linear(c1, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(self.norm(x.mean(dim=(2, 3))))


def make_convnext_job(batch: int = 8, size: int = 32) -> Job:
    torch.manual_seed(0)
    model = ConvNeXt()
    return Job(
        model=model,
        loss_fn=F.cross_entropy,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        batches=_image_batches(batch, size, seed=6),
        name="convnext",
    )


# ---- a tied embedding on a task it fits at once ------------------------------------------


class TiedEmbeddingLM(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # GPT-2's tying

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(self.norm(x + self.mlp(x)))


def _copy_batches(batch: int, seq: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The targets are the tokens themselves: a tied head scores a token's own embedding
    about d above any other's, so the softmax's gradients are near e**-d."""
    for tokens, _ in _token_batches(batch, seq, seed):
        yield tokens, tokens


def make_tied_lm_job(batch: int = 8, seq: int = 64) -> Job:
    torch.manual_seed(0)
    model = TiedEmbeddingLM()
    return Job(
        model=model,
        loss_fn=_lm_loss,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        batches=_copy_batches(batch, seq, seed=7),
        name="tied_lm",
    )
