"""A small GPT-style character model on Shakespeare's sonnets (shipped, public domain).

Big enough that every step is dozens of real GEMMs (mm, bmm, addmm; the output head
shares the token embedding, so one weight is used twice), small enough that the loss
falls visibly within a demo on two CPU cores.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.step.job import Job


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 64  # context length T
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128  # C
    batch_size: int = 16  # B
    lr: float = 1e-3


def load_text() -> str:
    return resources.files("coordinator.jobs").joinpath("data/sonnets.txt").read_text("utf-8")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.mask: torch.Tensor
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)  # (B, nh, T, T): bmm
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig, vocab_size: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layer)])
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying: one parameter, two uses
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, C)
        return self.head(self.ln(self.blocks(x)))  # (B, T, vocab)


def _init_weights(module: nn.Module) -> None:
    # GPT-2's small init: with N(0, 1) embeddings the tied head starts at loss ~80.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(
    data: torch.Tensor, cfg: GPTConfig, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random windows of the text, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(len(data) - cfg.block_size - 1, (cfg.batch_size,), generator=gen)
        x = torch.stack([data[s : s + cfg.block_size] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + 1 + cfg.block_size] for s in starts.tolist()])
        yield x, y


def make_job(
    seed: int = 0, cfg: GPTConfig = GPTConfig(), autocast: torch.dtype | None = None
) -> Job:
    text = load_text()
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    data = torch.tensor([index[ch] for ch in text], dtype=torch.long)
    torch.manual_seed(seed)
    model = TinyGPT(cfg, len(vocab))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    return Job(
        model=model,
        loss_fn=next_token_loss,
        optimizer=optimizer,
        batches=batches(data, cfg, seed),
        name="tiny_gpt" if autocast is None else f"tiny_gpt_{str(autocast).split('.')[-1]}",
        autocast=autocast,
        description=(
            "A small GPT-style language model learning to write like Shakespeare, one "
            "character at a time, from his sonnets. It is Cleave's built-in demonstration "
            "job: your computer multiplies pieces of its matrices, and the coordinator "
            "checks every piece before it counts."
        ),
    )


def make_bf16_job() -> Job:
    """The same model trained under ``torch.autocast("cpu", torch.bfloat16)``: mixed
    precision as large models train; its GEMM tiles travel in bf16."""
    return make_job(autocast=torch.bfloat16)
