"""``cleave-coordinator``: serve a job to workers and train it."""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import logging
import signal
import ssl
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from common.gemm_speed import matmul_gflops
from common.signing import fingerprint, load_or_create_private_key
from coordinator.config_file import ConfigError, read_config
from coordinator.plan.live import LivePlanning
from coordinator.plan.planner import plan_config_for
from coordinator.pool.ledger import Ledger
from coordinator.schedule.scheduler import SchedulerConfig
from coordinator.serve.local_workers import LocalWorkers
from coordinator.serve.offload import TileOffload
from coordinator.serve.server import WS_PATH, CoordinatorServer, ServerConfig
from coordinator.step.flops import describe
from coordinator.step.job import Job
from coordinator.step.progress import Progress
from coordinator.step.trainer import PoolCounters, StepRecord, Trainer
from coordinator.structured_log import LOG_FORMATS, PROGRESS_LOGGER, configure

log = logging.getLogger("cleave.coordinator")
progress_log = logging.getLogger(PROGRESS_LOGGER)
# Stopped by a signal, after the checkpoint: the shell's convention, 128 + signal number.
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143


class RunAborted(Exception):
    """The run cannot go on; the message says why and what to look at."""


def load_job(spec: str) -> Job:
    """``MODULE:FACTORY`` -> ``FACTORY()``, with errors a user can act on."""
    module_name, sep, factory_name = spec.partition(":")
    if not sep or not module_name or not factory_name:
        raise SystemExit(f"--job must look like MODULE:FACTORY, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"cannot import {module_name!r} (is it on PYTHONPATH?): {exc}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise SystemExit(f"{module_name} has no callable {factory_name!r}")
    try:
        job = factory()
    except Exception as exc:
        log.exception("the job factory %s failed", spec)
        raise SystemExit(f"{spec}() raised {type(exc).__name__}: {exc}") from None
    if not isinstance(job, Job):
        raise SystemExit(f"{spec} returned {type(job).__name__}, not a coordinator.Job")
    return job


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cleave-coordinator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a job to workers and train it")
    serve.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="read options from this TOML file (keys are option names: steps = 100, "
        'state-dir = "/var/lib/cleave"); options on the command line win',
    )
    serve.add_argument(
        "--job",
        default="coordinator.jobs.tiny_gpt:make_job",
        help="MODULE:FACTORY returning a coordinator.Job (default: built-in tiny GPT)",
    )
    serve.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    serve.add_argument(
        "--port", type=int, default=8765, help="port for workers and status (0: any)"
    )
    serve.add_argument(
        "--tls-cert",
        type=Path,
        metavar="PEM",
        help="serve wss:// and https:// with this certificate (chain); needs --tls-key",
    )
    serve.add_argument("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert")
    serve.add_argument(
        "--state-dir",
        type=Path,
        default=Path("cleave-state"),
        help="coordinator key, ledger and logs (default ./cleave-state)",
    )
    serve.add_argument("--metrics-out", type=Path, help="append one JSON object per step here")
    serve.add_argument(
        "--checkpoint-every",
        type=int,
        default=1,
        help="write STATE_DIR/checkpoint.pt every N steps and at the end (default 1: "
        "small jobs checkpoint cheaply); a restart with the same --state-dir resumes",
    )
    serve.add_argument(
        "--fresh",
        action="store_true",
        help="start from step 0: discard STATE_DIR/checkpoint.pt (the key and ledger stay)",
    )
    serve.add_argument(
        "--local-workers",
        type=int,
        default=0,
        help="start K cleave-worker processes against this coordinator",
    )
    serve.add_argument(
        "--local-worker-threads",
        type=int,
        default=None,
        help="torch threads per local worker (default: cores / K)",
    )
    serve.add_argument(
        "--min-workers",
        type=int,
        default=None,
        help="wait for this many workers before training (default 1, or K local)",
    )
    serve.add_argument(
        "--min-offload-mflop",
        type=float,
        default=1.0,
        help="GEMMs smaller than this many MFLOP run at the coordinator",
    )
    serve.add_argument(
        "--planner",
        default="cost",
        choices=["cost", "grid"],
        help="cost (default): each GEMM's grid from the cost model of the connected "
        "workers (their measured speeds and links); grid: about two tiles per worker",
    )
    serve.add_argument(
        "--coordinator-gflops",
        default="auto",
        metavar="GFLOPS|auto",
        help="the coordinator's own fp32 speed; with the cost planner it then computes the "
        "tiles it would finish before any worker (auto: measured at start-up, 0 while "
        "--local-workers share this machine; 0: never)",
    )
    serve.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="seconds without a heartbeat before a worker's tiles are re-issued",
    )
    serve.add_argument(
        "--speculate-after",
        type=float,
        default=3.0,
        metavar="RATIO",
        help="copy a tile to an idle worker once its holder's predicted finish is more "
        "than RATIO times what the idle worker needs (default 3; 0 turns copies off)",
    )
    serve.add_argument(
        "--leave-for-faster",
        type=float,
        default=0.0,
        metavar="RATIO",
        help="a worker with a free slot passes on a fresh tile that another worker (busy "
        "now, perhaps) is predicted to return RATIO times sooner (0, the default: off; "
        "in simulated pools it helped on fast LANs and hurt on slower links)",
    )
    serve.add_argument(
        "--join-token",
        default="",
        metavar="TOKEN",
        help="private pool: only workers that present this token may join "
        "(use with TLS, or the token crosses the network in clear)",
    )
    serve.add_argument(
        "--handshake-timeout",
        type=float,
        default=10.0,
        help="seconds a new connection has to authenticate before it is closed",
    )
    serve.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="diagnostics at or above this level (default INFO); progress is always shown",
    )
    serve.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text (default): progress on stdout, diagnostics on stderr; json: one JSON "
        "object per line on stdout for everything, step records with their fields",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, over the ``--config`` file's values, over the defaults."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    serve_parser = subcommand_parser(parser, args.command)
    try:
        values = read_config(args.config, serve_parser)
    except ConfigError as exc:
        parser.exit(2, f"cleave-coordinator: --config: {exc}\n")
    # The file's values become defaults, so the same command line parsed again wins.
    serve_parser.set_defaults(**values)
    return parser.parse_args(argv)


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise LookupError(name)  # pragma: no cover - build_parser always has subcommands


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure(args.log_format, getattr(logging, args.log_level))
    if log.getEffectiveLevel() > logging.DEBUG:
        # One line per HTTP request and connection drowns the training output.
        logging.getLogger("websockets").setLevel(logging.WARNING)
    return asyncio.run(serve(args))


def tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """``--tls-cert``/``--tls-key`` -> a server context, or None for plain ws://."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise SystemExit("--tls-cert and --tls-key go together: give both or neither")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(certfile=cert, keyfile=key)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(f"cannot load --tls-cert {cert} / --tls-key {key}: {exc}") from None
    return ctx


def _print(text: str, **fields: Any) -> None:
    """Progress for the operator: a plain line on stdout, or a JSON record with ``fields``."""
    progress_log.info(text, extra=fields)


def _coordinator_gflops(value: str, local_workers: int) -> float:
    """--coordinator-gflops as a number. auto measures this machine, unless local workers
    run here too: they already use its cores, and a share for the coordinator would
    compete with them while the planner counts both."""
    if value != "auto":
        try:
            gflops = float(value)
        except ValueError:
            raise SystemExit(
                f"--coordinator-gflops must be a number or auto, not {value!r}"
            ) from None
        if not gflops >= 0 or gflops == float("inf"):
            raise SystemExit("--coordinator-gflops must be >= 0 and finite")
        return gflops
    if local_workers:
        return 0.0
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    return matmul_gflops(a, b, target_s=0.2)


async def serve(args: argparse.Namespace) -> int:
    if args.steps < 0 or args.local_workers < 0:
        raise SystemExit("--steps and --local-workers must be >= 0")
    if args.speculate_after and args.speculate_after < 1:
        raise SystemExit("--speculate-after must be >= 1 (or 0 to turn copies off)")
    if args.leave_for_faster and args.leave_for_faster < 1:
        raise SystemExit("--leave-for-faster must be >= 1 (or 0 to turn it off)")
    if args.checkpoint_every < 1:
        raise SystemExit("--checkpoint-every must be >= 1")
    coordinator_gflops = _coordinator_gflops(args.coordinator_gflops, args.local_workers)
    if args.min_workers is not None and args.min_workers < 1:
        raise SystemExit("--min-workers must be >= 1: tiles need someone to compute them")
    min_workers = args.min_workers if args.min_workers is not None else max(1, args.local_workers)
    ssl_context = tls_context(args.tls_cert, args.tls_key)
    job = load_job(args.job)  # before touching the state directory: a typo creates nothing
    state_dir: Path = args.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    key = load_or_create_private_key(state_dir / "coordinator.key")
    ledger = Ledger(state_dir / "ledger.sqlite")
    progress = Progress(args.steps)
    server = CoordinatorServer(
        key=key,
        job_name=job.name,
        ledger=ledger,
        config=ServerConfig(
            handshake_timeout_s=args.handshake_timeout,
            # Several heartbeats per timeout, so one late beat never drops a worker.
            heartbeat_interval_s=min(ServerConfig.heartbeat_interval_s, args.heartbeat_timeout / 4),
            join_token=args.join_token,
            scheduler=SchedulerConfig(
                heartbeat_timeout_s=args.heartbeat_timeout,
                speculate_after=args.speculate_after or None,
                leave_for_faster=args.leave_for_faster or None,
            ),
        ),
        status_extra=progress.status,
    )
    port = await server.start(args.host, args.port, ssl_context=ssl_context)
    # What is alive now (modules, the job, its model) lives for the whole run: keep it out
    # of the full garbage collections, which otherwise pause the event loop for 0.2 s+
    # with a thousand workers connected (bench/bench_load.py).
    gc.freeze()
    connect_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    ws, http = ("wss", "https") if ssl_context is not None else ("ws", "http")
    url = f"{ws}://{connect_host}:{port}{WS_PATH}"
    _print(f"Cleave coordinator for job {job.name!r} on {url}", url=url, job=job.name)
    _print(f"  dashboard:       {http}://{connect_host}:{port}/")
    _print(f"  status:          {http}://{connect_host}:{port}/api/status")
    _print(f"  metrics:         {http}://{connect_host}:{port}/metrics")
    _print(f"  key fingerprint: {fingerprint(key)}")
    if args.planner == "grid":
        _print("  planner:         grid (about two tiles per worker)")
    elif coordinator_gflops:
        _print(
            "  planner:         cost model; this machine computes a share "
            f"({coordinator_gflops:.0f} GFLOP/s)"
        )
    else:
        _print("  planner:         cost model; every tile goes to workers")
    if args.host in ("0.0.0.0", "::", ""):
        _print(f"  connect a worker: cleave-worker --coordinator {ws}://THIS-HOST:{port}{WS_PATH}")
        _print(f"  (local workers use {url})")
    else:
        _print(f"  connect a worker: cleave-worker --coordinator {url}")

    loop = asyncio.get_running_loop()
    cancel = threading.Event()
    stop_signal: signal.Signals | None = None
    in_trainer = False  # the training thread runs: it must finish before we checkpoint

    def on_signal(sig: signal.Signals) -> None:
        nonlocal stop_signal
        if stop_signal is not None:
            log.warning("%s again: still stopping (checkpoint first)", sig.name)
            return
        stop_signal = sig
        progress.state = "stopping"
        log.info("%s: stopping; the last completed step is checkpointed first", sig.name)
        cancel.set()
        # Waiting for workers is safe to cut short; a running step notices ``cancel``.
        if not in_trainer and not training.done():
            training.cancel()

    local = LocalWorkers(
        args.local_workers,
        url,
        state_dir,
        args.local_worker_threads,
        # They connect to 127.0.0.1 or the --host name: the certificate must name it.
        ca_file=args.tls_cert.resolve() if ssl_context is not None else None,
    )
    offload = TileOffload(
        server,
        loop,
        key,
        plan_config_for(args.min_offload_mflop),
        LivePlanning(
            cost_model=args.planner == "cost",
            coordinator_flops_per_s=coordinator_gflops * 1e9,
        ),
    )
    trainer = Trainer(
        job,
        offload,
        # Plain ints and an immutable snapshot: safe to read from the training thread.
        pool_counters=lambda: PoolCounters(
            server.counters.tiles_verified,
            server.counters.reissued,
            server.pool.workers,
            server.counters.flops_computed_here,
        ),
        metrics_out=args.metrics_out,
        cancel=cancel,
        checkpoint_path=state_dir / "checkpoint.pt",
        checkpoint_every=args.checkpoint_every,
    )
    if args.fresh:
        (state_dir / "checkpoint.pt").unlink(missing_ok=True)
    try:
        resumed = trainer.resume()
    except Exception as exc:
        await server.close()
        ledger.close()
        raise SystemExit(
            f"cannot resume from {state_dir / 'checkpoint.pt'} ({type(exc).__name__}: {exc}); "
            "is it from another job? Move it away to start over."
        ) from None
    if resumed:
        _print(f"resuming from step {trainer.step} of {args.steps}")
        if trainer.step >= args.steps:
            _print(
                f"this state directory has already trained {trainer.step} steps: raise "
                "--steps to go on, or pass --fresh to start over"
            )
    progress.step = trainer.step
    progress.checkpoint_step = trainer.checkpointed_step

    def on_step(record: StepRecord) -> None:  # on the training thread
        progress.add(record, trainer.dag.get("gflop"), trainer.checkpointed_step, trainer.flops)
        _print(
            f"step {record.step:4d}  loss {record.loss:.4f}  {record.seconds:6.2f} s  "
            f"tiles {record.tiles:4d}  reissued {record.reissued:3d}  workers {record.workers}",
            event="step",
            **asdict(record),
        )

    async def train() -> None:
        nonlocal in_trainer
        progress.state = "waiting for workers"
        waited = time.monotonic()
        while server.pool.active < min_workers:
            if local.count and local.all_exited():
                raise RunAborted(
                    f"all {local.count} local workers exited before training could start; "
                    f"their logs are in {local.dir}"
                )
            _print(f"waiting for workers: {server.pool.active}/{min_workers} connected")
            try:
                await asyncio.wait_for(server.wait_for_workers(min_workers), 10)
            except asyncio.TimeoutError:
                continue
        log.info(
            "%d workers after %.1f s; training %d steps",
            server.pool.active,
            time.monotonic() - waited,
            max(0, args.steps - trainer.step),
        )
        progress.state = "training"
        if cancel.is_set():
            return
        in_trainer = True  # no await since the check above: no signal slipped between
        # --steps is the total: after a resume, only the steps still missing are trained.
        await asyncio.to_thread(trainer.run, max(0, args.steps - trainer.step), on_step)
        progress.state = "done"

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    local.start()
    training = asyncio.ensure_future(train())
    failed: str | None = None
    try:
        await training
    except RunAborted as exc:
        failed = str(exc)
    except (asyncio.CancelledError, Exception) as exc:
        if stop_signal is None:
            log.exception("training failed")
            failed = f"training failed: {type(exc).__name__}: {exc}"
    finally:
        cancel.set()
        # By now the training thread has returned and trainer.run has checkpointed the
        # last completed step; only then do the workers go and the server close.
        if trainer.checkpointed_step is not None:
            progress.checkpoint_step = trainer.checkpointed_step
            _print(
                f"checkpoint: step {trainer.checkpointed_step} in {state_dir / 'checkpoint.pt'}",
                event="checkpoint",
                step=trainer.checkpointed_step,
            )
        progress.state = "failed" if failed else "stopped" if stop_signal else progress.state
        await asyncio.to_thread(local.stop)
        await server.close()
        _print_traffic(server)
        if trainer.flops:
            _print(f"FLOPs of the last step: {describe(trainer.flops)}", flops=trainer.flops)
        _print_contributions(ledger)
        ledger.close()
    if failed is not None:
        _print(f"error: {failed}")
        return 1
    if stop_signal is not None:
        _print(f"stopped by {stop_signal.name}", event="stopped", signal=stop_signal.name)
        return EXIT_TERMINATED if stop_signal == signal.SIGTERM else EXIT_INTERRUPTED
    return 0


def _print_traffic(server: CoordinatorServer) -> None:
    counters = server.counters
    if not counters.tiles_sent:
        return
    down, uncached = counters.bytes_down, counters.bytes_down_uncached
    saved = max(0.0, 1 - down / uncached) if uncached else 0.0
    _print(
        f"\ntraffic this run: {down / 1e6:.1f} MB to workers ({uncached / 1e6:.1f} MB without "
        f"their operand caches: {saved:.0%} saved), {counters.bytes_up / 1e6:.1f} MB back"
    )
    if counters.bytes_half:
        _print(
            f"bf16/fp16 tiles: {counters.bytes_half / 1e6:.1f} MB of that traffic; as fp32 "
            f"they would have been {2 * counters.bytes_half / 1e6:.1f} MB "
            f"({counters.bytes_half / 1e6:.1f} MB saved)"
        )
    if counters.kept_here:
        _print(
            f"tiles: {counters.tiles_verified} verified from workers, {counters.kept_here} "
            "computed here (the planner's share for the coordinator)"
        )


def _print_contributions(ledger: Ledger) -> None:
    rows = ledger.all()
    if not rows:
        return
    _print("\ncontributions (verified, all time; workers are known by their key):")
    _print(
        f"  {'worker':<20} {'key':<9} {'tiles':>7} {'GFLOP':>9} {'MB down':>9} {'MB up':>8} "
        f"{'rejected':>8} {'reputation':>10}"
    )
    for c in rows:
        standing = "BANNED" if c.banned_reason else f"{c.reputation:.2f}"
        _print(
            f"  {c.name[:20]:<20} {c.key_fingerprint[:9]:<9} {c.tiles:>7} {c.gflop:>9.2f} "
            f"{c.bytes_down / 1e6:>9.1f} {c.bytes_up / 1e6:>8.1f} {c.rejected:>8} {standing:>10}"
        )


if __name__ == "__main__":
    sys.exit(main())
