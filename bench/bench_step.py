"""Step time and memory of GEMM-heavy models: Cleave with local workers vs eager torch.

Both run on this machine's cores, each as a process of its own: eager torch with all of
them, Cleave as a coordinator plus ``--local-workers`` worker processes splitting the
cores. The coordinator runs as a real subprocess (``cleave-coordinator serve``) and
reports per-step seconds through ``--metrics-out``; the first steps (tracing, warm-up)
are left out of both medians. Memory is each process's peak RSS: the eager process
against the coordinator's (its workers are processes of their own).

Models: ``mlp`` (a wide MLP: nine large GEMMs a step and little else) and ``gpt`` (a
GPT-style model, 12 layers 768 wide, 12 heads, 128-token context, batch 8, on the
character text of the built-in job: 85M parameters).
Run: ``python bench/bench_step.py [--model mlp|gpt|both] [--steps 8] [--workers 2]``.
Profile the coordinator with ``py-spy record --subprocesses -o step.svg -- python -m
coordinator serve --job bench_step:make_job --steps 8 --local-workers 2 --port 0``
(one worker alone: ``py-spy record --threads -p <its pid>``).

After the ratios it prints where each step's core-seconds went: the coordinator's CPU by
stage and by thread (from ``--metrics-out``, coordinator.step.cpu_costs), the workers'
reported GEMM seconds, and, sampled here at each step's end, the CPU of the coordinator
process and of its local workers. The rows add up to cores x wall; what nobody spent is
idle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from coordinator.jobs.tiny_gpt import GPTConfig  # noqa: E402
from coordinator.jobs.tiny_gpt import make_job as make_tiny_gpt  # noqa: E402
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


def make_gpt_job() -> Job:
    """A GPT-style model of GPT-2 small's depth and width on the built-in job's text."""
    cfg = GPTConfig(block_size=128, n_layer=12, n_head=12, n_embd=768, batch_size=8, lr=3e-4)
    return make_tiny_gpt(cfg=cfg)


MODELS: dict[str, tuple[str, Callable[[], Job]]] = {
    "mlp": ("bench_step:make_job", make_job),
    "gpt": ("bench_step:make_gpt_job", make_gpt_job),
}


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


def eager_process(model: str, steps: int) -> tuple[list[float], int]:
    """Eager steps of ``model`` in a process of its own: seconds per step, peak RSS."""
    out = subprocess.run(
        [sys.executable, __file__, "--eager-only", model, "--steps", str(steps)],
        check=True,
        capture_output=True,
        text=True,
    )
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    return doc["seconds"], doc["peak_rss"]


def _peak_rss_self() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


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
    served = serve_job_measured(job, steps, workers, *extra, env=env, prepare=prepare)
    return served.seconds, served.output


@dataclass
class Served:
    """What one ``serve`` run measured: its metrics-out lines, its printed output, the
    coordinator's peak RSS, and at each step's end (sampled) the CPU seconds so far of
    the coordinator process and of its local workers."""

    records: list[dict[str, Any]]
    output: str
    peak_rss: int
    coordinator_cpu: list[float]
    workers_cpu: list[float]

    @property
    def seconds(self) -> list[float]:
        return [r["seconds"] for r in self.records]


def _cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def serve_job_measured(
    job: str,
    steps: int,
    workers: int,
    *extra: str,
    env: dict[str, str] | None = None,
    prepare: Callable[[Path], None] = lambda state: None,
) -> Served:
    """``serve_job``, with what ``Served`` holds besides."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics, state = Path(tmp) / "metrics.jsonl", Path(tmp) / "state"
        prepare(state)
        path = os.pathsep.join([str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")])
        log = (Path(tmp) / "serve.log").open("w")
        proc = subprocess.Popen(
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
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp,
        )
        peak = 0
        watched = psutil.Process(proc.pid)
        children: dict[int, psutil.Process] = {}
        coordinator_cpu: list[float] = []
        workers_cpu: list[float] = []
        while proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                peak = max(peak, watched.memory_info().rss)
                for child in watched.children(recursive=True):
                    children.setdefault(child.pid, child)
                lines = metrics.read_text().count("\n") if metrics.exists() else 0
                while lines > len(coordinator_cpu):  # a step ended since the last look
                    coordinator_cpu.append(_cpu_seconds([watched]))
                    workers_cpu.append(_cpu_seconds(list(children.values())))
            time.sleep(0.02)
        log.close()
        output = (Path(tmp) / "serve.log").read_text()
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, output)
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return Served(records, output, peak, coordinator_cpu, workers_cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "both"], default="mlp")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--eager-only", choices=list(MODELS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.eager_only:  # the baseline's own process (eager_process)
        seconds = eager_seconds(args.steps, MODELS[args.eager_only][1])
        print(json.dumps({"seconds": seconds, "peak_rss": _peak_rss_self()}))
        return
    skip = 2
    sizes = {"CLEAVE_BENCH_WIDTH": str(WIDTH), "CLEAVE_BENCH_BATCH": str(BATCH)}
    print(
        f"{'model':>28} {'GFLOP/step':>11} {'planner':>8} {'eager s':>8} {'cleave s':>9} "
        f"{'ratio':>6} {'memory':>7} {'ckpt s':>7}"
    )
    breakdowns: dict[str, dict[str, float]] = {}
    for model in MODELS if args.model == "both" else [args.model]:
        spec, make = MODELS[model]
        eager_times, eager_rss = eager_process(model, args.steps)
        eager = statistics.median(eager_times[skip:])
        gflop = step_gflop(make)
        label = f"MLP {WIDTH}x{WIDTH}, batch {BATCH}" if model == "mlp" else "GPT 12x768, 8x128 tok"
        for planner in ("cost", "grid"):
            served = serve_job_measured(
                spec, args.steps, args.workers, "--planner", planner, env=sizes
            )
            ours = statistics.median(served.seconds[skip:])
            ckpt = statistics.median(r["checkpoint_s"] for r in served.records[skip:])
            print(
                f"{label:>28} {gflop:>11.1f} {planner:>8} {eager:>8.3f} {ours:>9.3f} "
                f"{ours / eager:>6.2f} {served.peak_rss / eager_rss:>7.2f} "
                f"{ckpt:>7.3f}"
            )
            breakdowns[f"{model} {planner}"] = step_breakdown(served, skip)
        breakdowns[f"{model} eager"] = {"wall": eager, "cores x wall": eager * CORES}
    print(
        f"(cleave: coordinator + {args.workers} local workers on {CORES} cores; "
        f"medians of steps {skip}..{args.steps - 1}; memory: the coordinator's peak RSS "
        "over the eager process's; ckpt s: writing the checkpoint after each step, not in "
        "cleave s)"
    )
    print_breakdown(breakdowns, skip, args.steps)


CORES = os.cpu_count() or 1

# The rows of the per-step breakdown, in order: (row, what it is made of).
BREAKDOWN_ROWS = [
    ("wall", "seconds a step took"),
    ("cores x wall", "the machine's CPU time over the step and its checkpoint"),
    ("worker GEMMs", "the GEMM seconds workers reported for verified tiles"),
    ("worker rest", "the rest of the workers' CPU: receive, decode, encode, send"),
    ("cut", "coordinator: copy each operand block out of its matrix and hash it"),
    ("sign", "coordinator: frame and sign each task"),
    ("training rest", "coordinator: non-GEMM ops, optimizer, tracing, GEMM setup"),
    ("checkpoint", "coordinator: the checkpoint's snapshot, and its write on its own thread"),
    ("kept tiles", "coordinator: the GEMM tiles the planner kept here"),
    ("event loop", "coordinator: WebSocket send and receive, scheduling, credit"),
    ("decode", "coordinator: result frames into tensors"),
    ("check", "coordinator: Freivalds checks"),
    ("assemble", "coordinator: verified tiles into their GEMMs' outputs"),
    ("checks rest", "coordinator: the check thread's hand-offs, tiles computed there"),
    ("small checks", "coordinator: small tiles decoded, checked, placed on the event loop"),
    ("ledger", "coordinator: ledger commits"),
    ("other threads", "coordinator: everything else in its process"),
    ("idle", "cores x wall minus all of the above: nobody had work"),
]


def step_breakdown(served: Served, skip: int) -> dict[str, float]:
    """Mean core-seconds per step of each breakdown row over steps ``skip`` on (means,
    so the rows add up to cores x wall)."""
    rows: dict[str, float] = {name: 0.0 for name, _ in BREAKDOWN_ROWS}
    steps = range(max(1, skip), len(served.records))
    for i in steps:
        rec = served.records[i]
        cpu = defaultdict(float, rec["cpu"])  # a stage that did not run spent nothing
        worker_cpu = served.workers_cpu[i] - served.workers_cpu[i - 1]
        process_cpu = served.coordinator_cpu[i] - served.coordinator_cpu[i - 1]
        threads = sum(v for k, v in cpu.items() if k.startswith("thread:"))
        got = {
            "wall": rec["seconds"],
            # The checkpoint after the step is in the CPU sampled at its end.
            "cores x wall": (rec["seconds"] + rec["checkpoint_s"]) * CORES,
            "worker GEMMs": rec["worker_compute_s"],
            "worker rest": worker_cpu - rec["worker_compute_s"],
            "cut": cpu["cut"],
            "sign": cpu["sign"] + cpu["sign_variant"],
            "training rest": cpu["thread:training"]
            - cpu["cut"]
            - cpu["sign"]
            - cpu["kept_tiles"]
            - cpu["checkpoint"],
            "checkpoint": cpu["checkpoint"] + cpu["checkpoint_write"],
            "kept tiles": cpu["kept_tiles"],
            "event loop": cpu["thread:event_loop"] - cpu["sign_variant"] - cpu["check_on_loop"],
            "decode": cpu["decode"],
            "check": cpu["check"],
            "assemble": cpu["assemble"],
            "checks rest": cpu["thread:checks"] - cpu["decode"] - cpu["check"] - cpu["assemble"],
            "small checks": cpu["check_on_loop"],
            "ledger": cpu["thread:ledger"],
            "other threads": process_cpu - threads - cpu["checkpoint_write"],
        }
        used = sum(v for k, v in got.items() if k not in ("wall", "cores x wall"))
        got["idle"] = got["cores x wall"] - used
        for name, value in got.items():
            rows[name] += value / len(steps)
    return rows


def print_breakdown(breakdowns: dict[str, dict[str, float]], skip: int, steps: int) -> None:
    columns = list(breakdowns)
    print(f"\nWhere a step's time goes: core-seconds per step (means of steps {skip}..{steps - 1})")
    print(f"{'':>14} " + " ".join(f"{c:>10}" for c in columns))
    for name, meaning in BREAKDOWN_ROWS:
        cells = [breakdowns[c].get(name) for c in columns]
        print(
            f"{name:>14} "
            + " ".join(f"{v:>10.3f}" if v is not None else f"{'':>10}" for v in cells)
            + f"  {meaning}"
        )


def step_gflop(make: Callable[[], Job]) -> float:
    """GFLOP of one training step (torch's own FLOP counter)."""
    job = make()
    x, y = job.next_batch()
    with FlopCounterMode(display=False) as counter:
        job.loss_fn(job.model(x), y).backward()
    return counter.get_total_flops() / 1e9


if __name__ == "__main__":
    main()
