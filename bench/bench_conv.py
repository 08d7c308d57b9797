"""Convolutions on workers: how the CNN of tests/support/real_models.py fares by lowering.

Cleave lowers a convolution to GEMMs over its input's patch matrix (im2col). Where the
patch matrix is formed decides the bytes on the wire: it repeats every input value up to
kernel-size times. Compared here, side by side in one run:

- **worker im2col** (what Cleave does): tiles carry image blocks, workers unfold them;
- **coordinator im2col** (rejected): the same model with its convolutions written as
  ``F.unfold`` + matmul, so the coordinator forms the patches and sends them;
- **direct convolution tiles** (rejected, not built): a tile kind that runs the native
  convolution kernel on input and weight blocks; bytes modelled only.

Tables:

1. **Step** (measured): local eager torch against Cleave with local workers (a real
   ``cleave-coordinator serve`` subprocess): step time and bytes on the wire per step.
2. **Bytes per step by lowering** (modelled for all three at the same tile count per op).
3. **Kernel time** (measured, one thread): the step's convolutions as torch's native
   kernels against their im2col GEMMs (``coordinator.step.lowering``), what a worker runs.

Run: ``python bench/bench_conv.py [--steps 8] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_step import eager_seconds, serve_job  # noqa: E402
from real_models import make_cnn_job  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from coordinator.step import lowering  # noqa: E402
from coordinator.step.job import Job  # noqa: E402

aten = torch.ops.aten
TILES = 4  # tiles per op in the byte model: two per local worker, as the planner aims


class UnfoldConv2d(torch.nn.Module):
    """A Conv2d written as im2col + matmul in the model, as some code does: the trace
    then holds the patch matrix at the coordinator (the rejected lowering)."""

    def __init__(self, conv: torch.nn.Conv2d) -> None:
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias
        self.stride, self.padding, self.groups = conv.stride, conv.padding, conv.groups
        self.dilation = conv.dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        o, cg, kh, kw = self.weight.shape
        cols = F.unfold(x, (kh, kw), self.dilation, self.padding, self.stride)
        ho = (h + 2 * self.padding[0] - self.dilation[0] * (kh - 1) - 1) // self.stride[0] + 1
        wo = (w + 2 * self.padding[1] - self.dilation[1] * (kw - 1) - 1) // self.stride[1] + 1
        g, og = self.groups, o // self.groups
        patches = cols.view(n, g, cg * kh * kw, -1).transpose(2, 3)  # (n, g, L, cg·kk)
        weights = self.weight.view(g, og, -1).transpose(1, 2)  # (g, cg·kk, og)
        out = (patches @ weights).permute(0, 1, 3, 2).reshape(n, o, ho, wo)
        return out if self.bias is None else out + self.bias.view(1, -1, 1, 1)


def make_coordinator_im2col_job() -> Job:
    """The same job (same weights, same batches) with every Conv2d as UnfoldConv2d."""
    job = make_cnn_job()
    for module in list(job.model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Conv2d):
                setattr(module, name, UnfoldConv2d(child))
    return job


def cleave_run(steps: int, workers: int, job: str, link_mbit: float) -> tuple[list[float], float]:
    """Step seconds and bytes on the wire (both ways) per step; each local worker's link
    capped at ``link_mbit`` Mbit/s each way (its own bandwidth limit), 0: loopback speed."""

    def cap_links(state: Path) -> None:
        for i in range(
            workers
        ):  # the settings local worker i reads (coordinator.serve.local_workers)
            config = state / "local-workers" / f"worker-{i}"
            config.mkdir(parents=True)
            kibps = int(link_mbit * 1e6 / 8 / 1024)
            (config / "settings.json").write_text(json.dumps({"bandwidth_kbps": kibps}))

    seconds, stdout = serve_job(job, steps, workers, prepare=cap_links)
    traffic = re.search(r"traffic this run: ([\d.]+) MB to workers.*?([\d.]+) MB back", stdout)
    if traffic is None:
        raise SystemExit(f"no traffic line in the coordinator's output:\n{stdout}")
    total_mb = float(traffic.group(1)) + float(traffic.group(2))
    return seconds, total_mb * 1e6 / steps


class _Recorder(TorchDispatchMode):
    """Keeps every convolution call (forward and backward) of one eager step."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (aten.convolution.default, aten.convolution_backward.default):
            self.calls.append((func, tuple(a.clone() if torch.is_tensor(a) else a for a in args)))
        return out


def convolution_calls() -> list[tuple[Any, tuple[Any, ...]]]:
    job = make_cnn_job()
    x, y = job.next_batch()
    recorder = _Recorder()
    with recorder:
        job.loss_fn(job.model(x), y).backward()
    return recorder.calls


def _numel(shape: Any) -> int:
    return math.prod(shape)


def _grid_bytes(a: int, b: int, c: int) -> int:
    """Elements moved by the cheapest gm x gn grid of TILES tiles: A goes to every tile
    column, B to every tile row, C comes back once."""
    return min(gn * a + (TILES // gn) * b + c for gn in range(1, TILES + 1) if TILES % gn == 0)


def modelled_bytes(func: Any, args: tuple[Any, ...], itemsize: int = 4) -> tuple[int, ...]:
    """Bytes of one op at TILES tiles: (coordinator im2col, worker im2col, direct)."""
    if func is aten.convolution.default:
        x, w, groups, mask = args[0], args[1], args[8], (False, False)
        y = aten.convolution(*args)
        kinds = ["forward"]
    else:
        y, x, w, groups, mask = args[0], args[1], args[2], args[9], args[10]
        kinds = (["input grad"] if mask[0] else []) + (["weight grad"] if mask[1] else [])
    kk = _numel(w.shape[2:])
    x_n, w_n, y_n = _numel(x.shape) // groups, _numel(w.shape) // groups, _numel(y.shape) // groups
    patches = _numel(y.shape[2:]) * x.shape[0] * (x.shape[1] // groups) * kk
    totals = [0, 0, 0]
    for kind in kinds:
        if kind == "forward":  # patches @ Wᵀ -> y
            ways = [(patches, w_n, y_n), (x_n, w_n, y_n), (x_n, w_n, y_n)]
        elif kind == "input grad":  # grad_out @ W -> patch gradients (folded here) or dx
            # Cleave folds a strided convolution's patch gradients here (coordinator.step.lowering).
            strided = any(s > 1 for s in args[4])
            ways = [(y_n, w_n, patches), (y_n, w_n, patches if strided else x_n), (y_n, w_n, x_n)]
        else:  # grad_outᵀ @ patches -> dW
            ways = [(y_n, patches, w_n), (y_n, x_n, w_n), (y_n, x_n, w_n)]
        for i, (a, b, c) in enumerate(ways):
            totals[i] += groups * _grid_bytes(a, b, c) * itemsize
    return tuple(totals)


def _time(fn: Any, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_seconds(calls: list[tuple[Any, tuple[Any, ...]]]) -> tuple[float, float]:
    """(native, lowered) seconds for all of the step's convolutions, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        native = sum(_time(lambda f=f, a=a: f(*a)) for f, a in calls)
        lowered_fns = {
            aten.convolution.default: lowering.convolution,
            aten.convolution_backward.default: lowering.convolution_backward,
        }
        lowered = sum(_time(lambda f=f, a=a: lowered_fns[f](*a)) for f, a in calls)
    finally:
        torch.set_num_threads(threads)
    return native, lowered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--links", default="0,100", help="worker links to try, Mbit/s each way (0: unlimited)"
    )
    args = parser.parse_args()
    skip = 2
    eager = statistics.median(eager_seconds(args.steps, make_cnn_job)[skip:])
    print("1. a training step of the CNN (batch 16, 3x32x32), measured")
    print(f"{'run':>36} {'link':>9} {'step s':>8} {'ratio':>6} {'MB on the wire/step':>20}")
    print(f"{'local eager torch':>36} {'-':>9} {eager:>8.3f} {1.0:>6.2f} {'-':>20}")
    for link in (float(v) for v in args.links.split(",")):
        for label, job in (
            ("Cleave, worker im2col (chosen)", "real_models:make_cnn_job"),
            ("Cleave, coordinator im2col", "bench_conv:make_coordinator_im2col_job"),
        ):
            seconds, wire = cleave_run(args.steps, args.workers, job, link)
            ours = statistics.median(seconds[skip:])
            speed = f"{link:g} Mb/s" if link else "loopback"
            print(f"{label:>36} {speed:>9} {ours:>8.3f} {ours / eager:>6.2f} {wire / 1e6:>20.1f}")
    print(
        f"(Cleave: coordinator + {args.workers} local workers on {os.cpu_count()} cores, each "
        f"worker's link capped as shown; medians of steps {skip}..{args.steps - 1}; wire: both "
        "ways)\n"
    )

    calls = convolution_calls()
    print(f"2. MB per step of the convolutions' tiles, modelled at {TILES} tiles per GEMM (fp32)")
    header = ("coordinator im2col", "worker im2col", "direct conv")
    print(f"{'op':>22} {'input':>14} " + " ".join(f"{h:>19}" for h in header))
    totals = [0, 0, 0]
    for func, call_args in calls:
        row = modelled_bytes(func, call_args)
        totals = [t + r for t, r in zip(totals, row, strict=True)]
        name = "convolution" if func is aten.convolution.default else "convolution_backward"
        shape = "x".join(map(str, call_args[0 if name == "convolution" else 1].shape))
        print(f"{name:>22} {shape:>14} " + " ".join(f"{r / 1e6:>19.2f}" for r in row))
    print(f"{'all convolutions':>22} {'':>14} " + " ".join(f"{t / 1e6:>19.2f}" for t in totals))
    print(
        f"{'ratio to direct conv':>22} {'':>14} "
        + " ".join(f"{t / totals[2]:>19.2f}" for t in totals)
        + "\n"
    )

    native, lowered = kernel_seconds(calls)
    print("3. the step's convolutions, forward and backward, one thread, measured")
    print(f"{'kernels':>34} {'seconds':>8} {'ratio':>6}")
    print(f"{'native (a direct tile kind)':>34} {native:>8.4f} {1.0:>6.2f}")
    print(f"{'im2col + GEMM (Cleave lowering)':>34} {lowered:>8.4f} {lowered / native:>6.2f}")


if __name__ == "__main__":
    main()
