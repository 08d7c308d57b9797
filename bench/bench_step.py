"""Step time and memory of GEMM-heavy models: Cleave with local workers vs eager torch.

Both run on this machine's cores, each as a process of its own: eager torch with all of
them, Cleave as a coordinator plus ``--local-workers`` worker processes splitting the
cores. The coordinator runs as a real subprocess (``cleave-coordinator serve``) and
reports per-step seconds through ``--metrics-out``; the first steps (``SKIP``: tracing,
warm-up, the first two checkpoints) are left out of both medians. Memory is each
process's peak RSS: the eager process against the coordinator's (its workers are
processes of their own).

Models: ``mlp`` (a wide MLP: nine large GEMMs a step and little else), ``gpt`` (a
GPT-style model, 12 layers 768 wide, 12 heads, 128-token context, batch 8, on the
character text of the built-in job: 85M parameters) and ``gpt-wide`` (2 layers 2048 wide,
16 heads, 512-token context, batch 8: 4,096 tokens a step).

The measure that decides whether a pool is worth having is the **orchestration ratio**:
the coordinator process's CPU seconds per step (every thread, but not the tiles it
multiplies itself) over eager torch's CPU seconds per step. Beside it the bench prints
its **floor**, measured in the same run: the step's own frames through a bare websockets
server, BLAKE3 over the blocks cut, three passes of the check over blocks and results at
one thread's memory speed, and eager's non-GEMM CPU. ``--pinned`` instead runs one core
each (coordinator on core 0, one 1-thread worker on core 1) against eager on core 0.
Run: ``python bench/bench_step.py [--model mlp|gpt|gpt-wide|all] [--planner
cost|grid|both] [--steps 9] [--workers 2] [--pinned]``.
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
import asyncio
import contextlib
import json
import math
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import blake3  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_egress import WORKERS, bare  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from common.tensors import content_id, stored_layout  # noqa: E402
from coordinator.jobs.tiny_gpt import GPTConfig  # noqa: E402
from coordinator.jobs.tiny_gpt import make_job as make_tiny_gpt  # noqa: E402
from coordinator.plan.live import Planner  # noqa: E402
from coordinator.step.heap import keep_freed_memory  # noqa: E402
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


def make_wide_gpt_job() -> Job:
    """A GPT-style model with 2048-wide layers and 4,096 tokens a step (8 x 512): the
    size at which a pool can be several times faster than its coordinator alone."""
    cfg = GPTConfig(block_size=512, n_layer=2, n_head=16, n_embd=2048, batch_size=8, lr=3e-4)
    return make_tiny_gpt(cfg=cfg)


MODELS: dict[str, tuple[str, Callable[[], Job]]] = {
    "mlp": ("bench_step:make_job", make_job),
    "gpt": ("bench_step:make_gpt_job", make_gpt_job),
    "gpt-wide": ("bench_step:make_wide_gpt_job", make_wide_gpt_job),
}
LABELS = {
    "mlp": f"MLP {WIDTH}x{WIDTH}, batch {BATCH}",
    "gpt": "GPT 12x768, 8x128 tok",
    "gpt-wide": "GPT 2x2048, 8x512 tok",
}
# The ops whose CPU eager spends multiplying (what workers take over); the rest of an
# eager step is the non-GEMM work the coordinator does in any case.
GEMM_OPS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}


def eager_seconds(steps: int, make: Callable[[], Job] = make_job) -> list[float]:
    """Seconds of each plain torch step of ``make()``'s job (the baseline)."""
    return eager_run(steps, make, profile=False).seconds


@dataclass
class EagerRun:
    """Plain torch steps: wall and process CPU seconds of each, the CPU seconds of a
    step spent outside its GEMMs (measured on one more step), and the bytes of a step's
    GEMM operands: each time a GEMM reads one, and their distinct contents (on one
    more)."""

    seconds: list[float]
    cpu_seconds: list[float]
    non_gemm_cpu_s: float
    operand_bytes: int = 0
    distinct_operand_bytes: int = 0


class _GemmCpu(TorchDispatchMode):
    """Process CPU seconds spent in GEMM ops (all of torch's threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func not in GEMM_OPS:
            return func(*args, **(kwargs or {}))
        start = time.process_time()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.process_time() - start
        return out


class _GemmOperands(TorchDispatchMode):
    """The bytes of the GEMMs' operands, counted each time a GEMM reads one, and the
    distinct contents among them. An operand is told by its bytes as they lie, so a
    transposed view is its matrix: a layer's input, read by its forward GEMM and as the
    transposed operand of its weight gradient, is one content read twice."""

    def __init__(self) -> None:
        super().__init__()
        self.read = 0
        self.distinct: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in GEMM_OPS:
            # addmm's first argument is the bias added, not a factor.
            for t in args[1:3] if func is torch.ops.aten.addmm.default else args[:2]:
                nbytes = t.numel() * t.element_size()
                self.read += nbytes
                self.distinct[content_id(stored_layout(t)[0])] = nbytes
        return func(*args, **(kwargs or {}))


def eager_run(steps: int, make: Callable[[], Job], *, profile: bool = True) -> EagerRun:
    job = make()

    def step() -> None:
        x, y = job.next_batch()
        job.optimizer.zero_grad()
        job.loss_fn(job.model(x), y).backward()
        job.optimizer.step()

    seconds, cpu = [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    non_gemm = 0.0
    if profile:
        gemms = _GemmCpu()
        cpu_start = time.process_time()
        with gemms:
            step()
        non_gemm = time.process_time() - cpu_start - gemms.seconds
        operands = _GemmOperands()
        with operands:
            step()
        return EagerRun(seconds, cpu, non_gemm, operands.read, sum(operands.distinct.values()))
    return EagerRun(seconds, cpu, non_gemm)


def eager_process(
    model: str, steps: int, *, threads: int = 0, core: int | None = None
) -> tuple[EagerRun, int]:
    """Eager steps of ``model`` in a process of its own (``threads`` torch threads, on
    ``core`` alone if given): what ``eager_run`` measured, and its peak RSS."""
    cmd = [sys.executable, __file__, "--eager-only", model, "--steps", str(steps)]
    out = subprocess.run(
        [*cmd, "--eager-threads", str(threads)],
        check=True,
        capture_output=True,
        text=True,
        preexec_fn=None if core is None else (lambda: os.sched_setaffinity(0, {core})),
    )
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    rss = doc.pop("peak_rss")
    return EagerRun(**doc), rss


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
    parser.add_argument("--model", choices=[*MODELS, "all"], default="mlp")
    parser.add_argument(
        "--planner", choices=[*(p.value for p in Planner), "both"], default=Planner.COST.value
    )
    parser.add_argument(
        "--steps", type=int, default=9, help=f"steps a run; the first {SKIP} are left out"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--pinned",
        action="store_true",
        help="one core each: coordinator on core 0 and one 1-thread worker on core 1, "
        "against eager with 1 thread on core 0",
    )
    parser.add_argument("--eager-only", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument(
        "--min-offload-intensity",
        nargs="+",
        default=["auto"],
        help="serve --min-offload-intensity: GEMMs below this many FLOP per byte stay here "
        "(auto: serve's default; 0: none); several values: one run each against the same "
        "eager baseline (planner cost@F)",
    )
    parser.add_argument("--eager-threads", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.eager_only:  # the baseline's own process (eager_process)
        if args.eager_threads:
            torch.set_num_threads(args.eager_threads)
        run = eager_run(args.steps, MODELS[args.eager_only][1])
        print(json.dumps({**asdict(run), "peak_rss": _peak_rss_self()}))
        return
    if args.steps <= SKIP:
        parser.error(f"--steps must be above {SKIP}: the first {SKIP} are left out")
    models = list(MODELS) if args.model == "all" else [args.model]
    if args.pinned:
        pinned_table(models, args.steps)
        return
    planners = [p.value for p in Planner] if args.planner == "both" else [args.planner]
    sizes = {"CLEAVE_BENCH_WIDTH": str(WIDTH), "CLEAVE_BENCH_BATCH": str(BATCH)}
    print(
        f"{'model':>30} {'GFLOP/step':>11} {'planner':>8} {'eager s':>8} {'cleave s':>9} "
        f"{'ratio':>6} {'memory':>7} {'orch':>6} {'no ckpt':>8} {'floor':>6} "
        f"{'orch/floor':>11} {'workers':>8}"
    )
    breakdowns: dict[str, dict[str, float]] = {}
    floors: dict[str, Floor] = {}
    for model in models:
        spec, make = MODELS[model]
        eager, eager_rss = eager_process(model, args.steps)
        eager_s = statistics.median(eager.seconds[SKIP:])
        eager_cpu = statistics.median(eager.cpu_seconds[SKIP:])
        gflop = step_gflop(make)
        runs = [(p, f) for p in planners for f in args.min_offload_intensity]
        for planner, intensity in runs:
            label = planner if intensity == "auto" else f"{planner}@{intensity}"
            served = serve_job_measured(
                spec,
                args.steps,
                args.workers,
                "--planner",
                planner,
                "--min-offload-intensity",
                intensity,
                env=sizes,
            )
            records = served.records[SKIP:]
            ours = statistics.median(served.seconds[SKIP:])
            orch = statistics.median(r["orchestration_cpu_s"] for r in records)
            no_ckpt = statistics.median(
                r["orchestration_cpu_s"]
                - r["cpu"].get("checkpoint", 0.0)
                - r["cpu"].get("checkpoint_write", 0.0)
                for r in records
            )
            share = statistics.median(r["workers_flop_share"] or 0.0 for r in records)
            floor = measure_floor(records, eager)
            floors[f"{model} {label}"] = floor
            print(
                f"{LABELS[model]:>30} {gflop:>11.1f} {label:>8} {eager_s:>8.3f} {ours:>9.3f} "
                f"{ours / eager_s:>6.2f} {served.peak_rss / eager_rss:>7.2f} "
                f"{orch / eager_cpu:>6.2f} {no_ckpt / eager_cpu:>8.2f} "
                f"{floor.seconds / eager_cpu:>6.2f} {orch / floor.seconds:>11.2f} {share:>8.1%}"
            )
            breakdowns[f"{model} {label}"] = step_breakdown(served)
        breakdowns[f"{model} eager"] = {"wall": eager_s, "cores x wall": eager_s * CORES}
    print(
        f"(cleave: coordinator + {args.workers} local workers on {CORES} cores; "
        f"medians of steps {SKIP}..{args.steps - 1}; memory: the coordinator's peak RSS "
        "over the eager process's; orch: the orchestration ratio, the coordinator "
        "process's CPU seconds per step but for tiles it multiplied itself, over eager "
        "torch's CPU seconds per step; no ckpt: the same without the checkpoint's snapshot "
        "and write; floor: what the step's bytes cost at least (below), over eager's CPU; "
        "workers: the share of the step's FLOPs that workers computed)"
    )
    print_floors(floors)
    print_breakdown(breakdowns, args.steps)


CORES = os.cpu_count() or 1
# Steps left out of every median and mean: the first traces the step, and the second and
# third carry the writes of the first two checkpoints, off the training thread during
# the next step. Those two create the state directory's checkpoint files; every later
# write reuses the file two before it (common.atomic_file.write_recycling), whose pages
# the kernel already holds. Filling a new file takes its pages from free memory, which
# can cost the kernel several times a rewrite (docs/benchmarks.md), once per run: a long
# run pays the rewrites, which is what the steady steps measure.
SKIP = 3


@dataclass
class Floor:
    """What a step's bytes cost a coordinator at least, in CPU seconds per step: its
    tiles through bare websockets (the same frames each way), hashing each block once,
    three passes of the check over the blocks and results at one thread's memory speed,
    and eager torch's own non-GEMM work, which the coordinator does in any case."""

    mb_down: float
    mb_up: float
    mb_cut: float
    # The eager step's GEMM operands, each time read and distinct (EagerRun).
    mb_operands: float
    mb_distinct: float
    websockets_s: float
    hash_s: float
    check_s: float
    non_gemm_s: float

    @property
    def seconds(self) -> float:
        return self.websockets_s + self.hash_s + self.check_s + self.non_gemm_s


def _best(fn: Callable[[], object], repeat: int = 3) -> float:
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _hash_seconds_per_byte() -> float:
    data = bytes(64 << 20)
    return _best(lambda: blake3.blake3(data).digest()) / len(data)


def _read_seconds_per_byte() -> float:
    """One thread reading memory as the check does: a matrix-vector product."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        matrix, vector = torch.rand(1 << 14, 1 << 12), torch.rand(1 << 12)
        return _best(lambda: torch.mv(matrix, vector)) / (matrix.numel() * 4)
    finally:
        torch.set_num_threads(threads)


def measure_floor(records: list[dict[str, Any]], eager: EagerRun) -> Floor:
    """The floor of the steps ``records`` describe (medians), measured now."""
    down = statistics.median(r["bytes_down"] for r in records)
    up = statistics.median(r["bytes_up"] for r in records)
    cut = statistics.median(r["bytes_cut"] for r in records)
    tiles = max(1, int(statistics.median(r["tiles"] for r in records)))
    # As many frames of the step's mean sizes, at most 256 MB of them, scaled to a step.
    frames = max(16, min(tiles, int((256 << 20) // max(1, (down + up) // tiles))))
    frames -= frames % WORKERS
    # The bare connection in a process set up as the coordinator's (not at this script's
    # entry: the eager baseline runs it too, and must keep glibc's defaults).
    keep_freed_memory()
    sent, cpu = asyncio.run(bare(int(down // tiles), int(up // tiles), frames))
    return Floor(
        mb_down=down / 1e6,
        mb_up=up / 1e6,
        mb_cut=cut / 1e6,
        mb_operands=eager.operand_bytes / 1e6,
        mb_distinct=eager.distinct_operand_bytes / 1e6,
        websockets_s=cpu * tiles / frames,
        hash_s=cut * _hash_seconds_per_byte(),
        check_s=3 * (cut + up) * _read_seconds_per_byte(),
        non_gemm_s=eager.non_gemm_cpu_s,
    )


def print_floors(floors: dict[str, Floor]) -> None:
    print("\nThe floor: CPU seconds per step a coordinator spends at least on these bytes")
    print(
        f"{'run':>14} {'MB down':>8} {'MB up':>7} {'MB cut':>7} {'MB read':>8} "
        f"{'MB distinct':>12} {'websockets':>11} {'hash':>6} {'check':>6} {'non-GEMM':>9} "
        f"{'floor s':>8}"
    )
    for name, f in floors.items():
        print(
            f"{name:>14} {f.mb_down:>8.1f} {f.mb_up:>7.1f} {f.mb_cut:>7.1f} "
            f"{f.mb_operands:>8.1f} {f.mb_distinct:>12.1f} {f.websockets_s:>11.3f} "
            f"{f.hash_s:>6.3f} {f.check_s:>6.3f} {f.non_gemm_s:>9.3f} {f.seconds:>8.3f}"
        )
    print(
        f"(websockets: the step's frames through a bare websockets server and {WORKERS} "
        "receivers, each answered with a frame of the result's mean size, in this run; "
        "MB read: the GEMM operands of an eager step, each time a GEMM reads one; MB "
        "distinct: their distinct contents, a tensor that two GEMMs read (a layer's input "
        "in its forward and its weight gradient) once; hash: BLAKE3 of the blocks cut; "
        "check: three passes over the blocks cut and the results at one thread's memory "
        "speed; non-GEMM: eager torch's CPU outside its GEMMs)"
    )


# The rows of the per-step breakdown, in order: (row, what it is made of).
BREAKDOWN_ROWS = [
    ("wall", "seconds a step took"),
    ("cores x wall", "the machine's CPU time over the step and its checkpoint"),
    ("worker GEMMs", "the GEMM seconds workers reported for verified tiles"),
    ("worker rest", "the rest of the workers' CPU: receive, decode, encode, send"),
    ("cut", "coordinator: lay each operand block out (a copy, unless in order already), hash it"),
    ("sign", "coordinator: frame and sign each task"),
    ("kept GEMMs", "coordinator: whole GEMMs computed here (too small, or too few FLOPs a byte)"),
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _on_core(core: int) -> Callable[[], None]:
    return lambda: os.sched_setaffinity(0, {core})


def pinned_steps(model: str, steps: int) -> list[float]:
    """Seconds of each step of ``model`` through Cleave with the coordinator on core 0
    and one 1-thread worker on core 1."""
    spec, _ = MODELS[model]
    port = _free_port()
    path = os.pathsep.join([str(ROOT), str(ROOT / "bench")])
    env = {**os.environ, "PYTHONPATH": path, "CLEAVE_BENCH_WIDTH": str(WIDTH)}
    env["CLEAVE_BENCH_BATCH"] = str(BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        serve = [sys.executable, "-m", "coordinator", "serve", "--job", spec]
        serve += ["--steps", str(steps), "--local-workers", "0", "--min-workers", "1"]
        serve += ["--port", str(port), "--state-dir", str(Path(tmp) / "state")]
        serve += ["--metrics-out", str(metrics)]
        work = [sys.executable, "-m", "client_app", "--coordinator"]
        work += [f"ws://127.0.0.1:{port}/ws", "--name", "pinned", "--threads", "1"]
        with (Path(tmp) / "serve.log").open("w") as log:
            coordinator = subprocess.Popen(
                serve,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp,
                preexec_fn=_on_core(0),
            )
            worker = subprocess.Popen(
                work,
                env={**env, "CLEAVE_CONFIG_DIR": str(Path(tmp) / "worker")},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=_on_core(1),
            )
            try:
                code = coordinator.wait(3600)
            finally:
                worker.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.wait(10)
                worker.kill()
        if code != 0:
            raise subprocess.CalledProcessError(code, serve, (Path(tmp) / "serve.log").read_text())
        return [json.loads(line)["seconds"] for line in metrics.read_text().splitlines()]


def pinned_table(models: list[str], steps: int) -> None:
    if CORES < 2:
        raise SystemExit("--pinned needs two cores")
    print(f"{'model':>30} {'eager s (1 core)':>17} {'cleave s (1 + 1)':>17} {'ratio':>6}")
    for model in models:
        eager, _ = eager_process(model, steps, threads=1, core=0)
        eager_s = statistics.median(eager.seconds[SKIP:])
        ours = statistics.median(pinned_steps(model, steps)[SKIP:])
        print(f"{LABELS[model]:>30} {eager_s:>17.3f} {ours:>17.3f} {ours / eager_s:>6.2f}")
    print(
        "(eager: 1 torch thread pinned to core 0; cleave: the coordinator pinned to core "
        f"0, one 1-thread worker pinned to core 1; medians of steps {SKIP}..{steps - 1})"
    )


def step_breakdown(served: Served) -> dict[str, float]:
    """Mean core-seconds per step of each breakdown row over steps ``SKIP`` on (means,
    so the rows add up to cores x wall)."""
    rows: dict[str, float] = {name: 0.0 for name, _ in BREAKDOWN_ROWS}
    steps = range(SKIP, len(served.records))
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
            "kept GEMMs": cpu["kept_gemms"],
            "training rest": cpu["thread:training"]
            - cpu["cut"]
            - cpu["sign"]
            - cpu["kept_tiles"]
            - cpu["kept_gemms"]
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


def print_breakdown(breakdowns: dict[str, dict[str, float]], steps: int) -> None:
    columns = list(breakdowns)
    print(f"\nWhere a step's time goes: core-seconds per step (means of steps {SKIP}..{steps - 1})")
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
