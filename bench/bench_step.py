"""Step time of a GEMM-heavy model: Cleave with local workers vs local eager torch.

Both run on this machine's cores: eager torch with all of them, Cleave as a coordinator
plus ``--local-workers`` worker processes splitting the cores. The coordinator runs as a
real subprocess (``cleave-coordinator serve``) and reports per-step seconds through
``--metrics-out``; the first steps (tracing, warm-up) are left out of both medians.
Run: ``python bench/bench_step.py [--width 2048] [--steps 8] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from coordinator.step.job import Job  # noqa: E402

WIDTH = int(os.environ.get("CLEAVE_BENCH_WIDTH", "2048"))
BATCH = int(os.environ.get("CLEAVE_BENCH_BATCH", "1024"))


def make_job() -> Job:
    """A wide MLP: every step is nine large GEMMs and little else."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 16),
    )
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 16, (BATCH,), generator=gen))
        for _ in range(4)
    ]
    return Job(
        model=model,
        loss_fn=F.cross_entropy,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        batches=(batches[i % 4] for i in range(10**6)),
        name="wide-mlp",
    )


def eager_seconds(steps: int, make: Callable[[], Job] = make_job) -> list[float]:
    """Seconds of each plain torch step of ``make()``'s job (the baseline)."""
    job = make()
    times = []
    for _ in range(steps):
        x, y = job.next_batch()
        start = time.perf_counter()
        job.optimizer.zero_grad()
        job.loss_fn(job.model(x), y).backward()
        job.optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def serve_job(
    job: str,
    steps: int,
    workers: int,
    *extra: str,
    env: dict[str, str] | None = None,
    prepare: Callable[[Path], None] = lambda state: None,
) -> tuple[list[float], str]:
    """``cleave-coordinator serve`` of ``job`` with local workers, as a subprocess in a
    fresh directory (``prepare`` gets its state directory first): per-step seconds from
    ``--metrics-out``, and what it printed."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics, state = Path(tmp) / "metrics.jsonl", Path(tmp) / "state"
        prepare(state)
        path = os.pathsep.join([str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")])
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "coordinator",
                "serve",
                "--job",
                job,
                "--steps",
                str(steps),
                "--local-workers",
                str(workers),
                "--port",
                "0",
                "--state-dir",
                str(state),
                "--metrics-out",
                str(metrics),
                *extra,
            ],
            env={**os.environ, "PYTHONPATH": path, **(env or {})},
            check=True,
            capture_output=True,
            text=True,
            cwd=tmp,
        )
        seconds = [json.loads(line)["seconds"] for line in metrics.read_text().splitlines()]
    return seconds, done.stdout


def cleave_seconds(steps: int, workers: int, planner: str) -> list[float]:
    sizes = {"CLEAVE_BENCH_WIDTH": str(WIDTH), "CLEAVE_BENCH_BATCH": str(BATCH)}
    seconds, _ = serve_job("bench_step:make_job", steps, workers, "--planner", planner, env=sizes)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    skip = 2
    eager = statistics.median(eager_seconds(args.steps)[skip:])
    gflop = 2 * BATCH * (2 * WIDTH * WIDTH + WIDTH * 16) * 3 / 1e9
    print(
        f"{'model':>28} {'GFLOP/step':>11} {'planner':>8} {'eager s':>8} {'cleave s':>9} "
        f"{'ratio':>6}"
    )
    for planner in ("cost", "grid"):
        ours = statistics.median(cleave_seconds(args.steps, args.workers, planner)[skip:])
        print(
            f"{f'MLP {WIDTH}x{WIDTH}, batch {BATCH}':>28} {gflop:>11.1f} {planner:>8} "
            f"{eager:>8.3f} {ours:>9.3f} {ours / eager:>6.2f}"
        )
    print(
        f"(cleave: coordinator + {args.workers} local workers on {os.cpu_count()} cores; "
        f"medians of steps {skip}..{args.steps - 1})"
    )


if __name__ == "__main__":
    main()
