"""Depthwise convolutions: computed at the coordinator, or shipped to workers?

Cleave keeps depthwise convolutions (one input channel a group: ConvNeXt, MobileNet,
EfficientNet) at the coordinator: as GEMMs they are one matrix-vector product per
channel, tiles too small to pay for their orchestration, and there is no data-only
depthwise tile kind. This bench measures, in one run and on one thread, what each choice
costs the coordinator per layer, forward and backward, at ConvNeXt's widths:

- **kept**: torch's native depthwise kernels (forward, input gradient, weight gradient);
- **shipped** (a tile kind not built; its least cost): the layer's bytes through a bare
  websockets connection (``bench_egress.bare``, measured now, per byte down and up), one
  BLAKE3 hash of what goes down, and the checks: the forward and the input gradient are
  linear in the batch, so a random combination of the batch's images checks them at the
  cost of one image's convolution (measured); the weight gradient has no such shortcut
  (measured as its own kernel's time).

A ratio below 1 means shipping would cost the coordinator less than computing here. The
last three columns ship only the forward and the input gradient (cheap to check) and
compute the weight gradient here.

Run: ``python bench/bench_depthwise.py [--batch 8]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_egress import WORKERS, bare  # noqa: E402
from bench_step import _hash_seconds_per_byte  # noqa: E402

# (channels, image side): ConvNeXt-T's four stages at 224 px, and the test model's two.
LAYERS = [(96, 56), (192, 28), (384, 14), (768, 7), (64, 8), (128, 4)]
KERNEL = 7


def _cpu(fn: Callable[[], object], budget_s: float = 0.6) -> float:
    """CPU seconds per call, averaged over at least ``budget_s`` after one warm-up call."""
    fn()
    start, calls = time.process_time(), 0
    while time.process_time() - start < budget_s:
        fn()
        calls += 1
    return (time.process_time() - start) / calls


def _websockets_s_per_byte(down: int, up: int) -> float:
    frames = 64 - 64 % WORKERS
    sent, cpu = asyncio.run(bare(down, up, frames))
    return cpu / (frames * (down + up))


def layer(batch: int, channels: int, side: int, per_byte: float, hash_per_byte: float) -> str:
    pad = KERNEL // 2
    x = torch.randn(batch, channels, side, side)
    w = torch.randn(channels, 1, KERNEL, KERNEL)
    g = torch.randn(batch, channels, side, side)

    def forward() -> torch.Tensor:
        return F.conv2d(x, w, padding=pad, groups=channels)

    def input_grad() -> object:
        return torch.ops.aten.convolution_backward(
            g, x, w, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], channels, [True, False, False]
        )

    def weight_grad() -> object:
        return torch.ops.aten.convolution_backward(
            g, x, w, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], channels, [False, True, False]
        )

    linear = _cpu(forward) + _cpu(input_grad)  # the two products linear in the batch
    kept = linear + _cpu(weight_grad)
    s = torch.randn(batch)

    def batch_check() -> object:  # Σ_n s_n conv(x_n) == conv(Σ_n s_n x_n), one image
        mixed = torch.einsum("n,nchw->chw", s, x)[None]
        return F.conv2d(mixed, w, padding=pad, groups=channels), torch.einsum("n,nchw->chw", s, g)

    image = 4 * batch * channels * side * side
    down = 4 * image  # x (forward), g (input grad), g and x (weight grad)
    up = 2 * image + 4 * w.numel()
    checks = 2 * _cpu(batch_check)
    shipped = (down + up) * per_byte + down * hash_per_byte + checks + _cpu(weight_grad)
    # Only the forward and the input gradient shipped; the weight gradient computed here.
    part = 2 * image * (per_byte + hash_per_byte) + 2 * image * per_byte + checks
    return (
        f"{channels:>9} {side:>3}x{side:<3} {(down + up) / 1e6:>9.1f} {kept * 1e3:>10.2f} "
        f"{shipped * 1e3:>12.2f} {shipped / kept:>7.2f} {linear * 1e3:>14.2f} {part * 1e3:>10.2f}"
        f" {part / linear:>7.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    per_byte = _websockets_s_per_byte(1 << 20, 1 << 20)
    hash_per_byte = _hash_seconds_per_byte()
    print(
        f"Depthwise {KERNEL}x{KERNEL} convolution, batch {args.batch}, fp32, forward and backward,"
        f" one thread; bare websockets {1e-9 / per_byte:.2f} GB per CPU-second"
    )
    print(
        f"{'channels':>9} {'image':>7} {'MB moved':>9} {'kept ms':>10} {'shipped ms':>12}"
        f" {'ratio':>7} {'fwd+dx kept':>14} {'shipped':>10} {'ratio':>7}"
    )
    for channels, side in LAYERS:
        print(layer(args.batch, channels, side, per_byte, hash_per_byte))
    print(
        "(kept: torch's native kernels; shipped: the least a data-only depthwise tile kind "
        "would cost the coordinator, the weight gradient's check at its own kernel's cost; "
        "fwd+dx: the forward and the input gradient alone, the weight gradient left here)"
    )


if __name__ == "__main__":
    main()
