"""``cleave-coordinator``: serve a job to workers and train it."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from common.errors import ConfigError
from coordinator.config_file import read_config
from coordinator.plan.live import Planner
from coordinator.run import CoordinatorRun
from coordinator.serve.local_workers import die_with_parent
from coordinator.serve_options import ServeOptions
from coordinator.step.heap import keep_freed_memory
from coordinator.step.job import Job
from coordinator.step.ranks import from_environment, rank_environment
from coordinator.structured_log import LOG_FORMATS, configure

log = logging.getLogger("cleave.coordinator")


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
    _job_options(serve.add_argument_group("the job and its run"))
    _network_options(serve.add_argument_group("network and trust"))
    _pool_options(serve.add_argument_group("workers and planning"))
    _log_options(serve.add_argument_group("logging"))
    return parser


def _job_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="read options from this TOML file (keys are option names: steps = 100, "
        'state-dir = "/var/lib/cleave"); options on the command line win',
    )
    group.add_argument(
        "--job",
        default="coordinator.jobs.tiny_gpt:make_job",
        help="MODULE:FACTORY returning a coordinator.Job (default: built-in tiny GPT)",
    )
    group.add_argument(
        "--job-name",
        metavar="NAME",
        help="the job's name as volunteers see it (default: the job's)",
    )
    group.add_argument(
        "--job-description",
        metavar="TEXT",
        help="what the job is for, in a short paragraph (at most 1,000 characters) shown "
        "in volunteers' apps and on the dashboard, as plain text",
    )
    group.add_argument(
        "--job-operator", metavar="WHO", help="who runs the job: a person, a lab, a company"
    )
    group.add_argument(
        "--job-link", metavar="URL", help="an http(s) address where volunteers read more"
    )
    group.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    group.add_argument(
        "--state-dir",
        type=Path,
        default=Path("cleave-state"),
        help="coordinator key, ledger and logs (default ./cleave-state)",
    )
    group.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="coordinator ranks on this host, each with its own port (PORT + rank), state "
        "directory (STATE_DIR/rank-N) and workers, training one model on slices of each "
        "batch (default 1). Across hosts: torchrun --nnodes ... -m coordinator serve",
    )
    group.add_argument(
        "--ledger",
        metavar="PATH|URL",
        help="where verified contributions are recorded: a SQLite file (default "
        "STATE_DIR/ledger.sqlite) or a PostgreSQL URL (postgresql://user@host/db), which "
        "several coordinators of one job can share",
    )
    group.add_argument("--metrics-out", type=Path, help="append one JSON object per step here")
    group.add_argument(
        "--checkpoint-every",
        type=int,
        default=1,
        help="write STATE_DIR/checkpoint.pt every N steps and at the end (default 1: "
        "small jobs checkpoint cheaply); a restart with the same --state-dir resumes",
    )
    group.add_argument(
        "--fresh",
        action="store_true",
        help="start from step 0: discard STATE_DIR/checkpoint.pt (the key and ledger stay)",
    )


def _network_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    group.add_argument(
        "--port", type=int, default=8765, help="port for workers and status (0: any)"
    )
    group.add_argument(
        "--public-host",
        help="the host name or address workers reach this coordinator at, where --host "
        "is every address (0.0.0.0, ::): shown in the connect line and told to the other "
        "coordinator ranks, whose front doors then send workers here",
    )
    group.add_argument(
        "--tls-cert",
        type=Path,
        metavar="PEM",
        help="serve wss:// and https:// with this certificate (chain); needs --tls-key",
    )
    group.add_argument("--tls-key", type=Path, metavar="PEM", help="private key of --tls-cert")
    group.add_argument(
        "--join-token",
        default="",
        metavar="TOKEN",
        help="private pool: only workers that present this token may join "
        "(use with TLS, or the token crosses the network in clear)",
    )
    group.add_argument(
        "--handshake-timeout",
        type=float,
        default=10.0,
        help="seconds a new connection has to authenticate before it is closed",
    )
    group.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="seconds without a heartbeat before a worker's tiles are re-issued",
    )


def _pool_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--local-workers",
        type=int,
        default=0,
        help="start K cleave-worker processes against this coordinator",
    )
    group.add_argument(
        "--local-worker-threads",
        type=int,
        default=None,
        help="torch threads per local worker (default: cores / K)",
    )
    group.add_argument(
        "--min-workers",
        type=int,
        default=None,
        help="wait for this many workers before training (default 1, or K local)",
    )
    group.add_argument(
        "--min-offload-mflop",
        type=float,
        default=1.0,
        help="GEMMs smaller than this many MFLOP run at the coordinator",
    )
    group.add_argument(
        "--min-offload-intensity",
        default="auto",
        metavar="FLOP_PER_BYTE|auto",
        help="GEMMs doing fewer FLOPs than this per byte they would move run at the "
        "coordinator, where handing them out costs its CPU more than computing them "
        "(0: off; auto, the default: below this machine's break-even, the least intense "
        "first, at most 5%% of the FLOPs)",
    )
    group.add_argument(
        "--planner",
        default=Planner.COST.value,
        choices=[p.value for p in Planner],
        help="cost (default): each GEMM's grid from the cost model of the connected "
        "workers (their measured speeds and links); grid: about two tiles per worker",
    )
    group.add_argument(
        "--coordinator-gflops",
        default="auto",
        metavar="GFLOPS|auto",
        help="the coordinator's own fp32 speed; with the cost planner it then computes the "
        "tiles it would finish before any worker (auto: measured at start-up, 0 while "
        "--local-workers share this machine; 0: never)",
    )
    group.add_argument(
        "--speculate-after",
        type=float,
        default=3.0,
        metavar="RATIO",
        help="copy a tile to an idle worker once its holder's predicted finish is more "
        "than RATIO times what the idle worker needs (default 3; 0 turns copies off)",
    )
    group.add_argument(
        "--leave-for-faster",
        type=float,
        default=0.0,
        metavar="RATIO",
        help="a worker with a free slot passes on a fresh tile that another worker (busy "
        "now, perhaps) is predicted to return RATIO times sooner (0, the default: off; "
        "in simulated pools it helped on fast LANs and hurt on slower links)",
    )


def _log_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="diagnostics at or above this level (default INFO); progress is always shown",
    )
    group.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text (default): progress on stdout, diagnostics on stderr; json: one JSON "
        "object per line on stdout for everything, step records with their fields",
    )


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
    if getattr(args, "ranks", 1) > 1 and "WORLD_SIZE" not in os.environ:
        return launch_ranks(args.ranks, _without_ranks(sys.argv[1:] if argv is None else argv))
    configure(args.log_format, getattr(logging, args.log_level))
    if log.getEffectiveLevel() > logging.DEBUG:
        # One line per HTTP request and connection drowns the training output.
        logging.getLogger("websockets").setLevel(logging.WARNING)
    keep_freed_memory()  # before the job's first buffers (coordinator.step.heap)
    return asyncio.run(serve(args))


async def serve(args: argparse.Namespace) -> int:
    options = ServeOptions.from_args(args)
    job = load_job(options.job)  # before touching the state directory: a typo creates nothing
    try:
        ranks = from_environment()  # torchrun's, or serve --ranks's, environment
    except RuntimeError as exc:  # gloo could not link the ranks to each other
        interface = (
            os.environ.get("GLOO_SOCKET_IFNAME")
            or "unset: the address this host's name resolves to"
        )
        raise SystemExit(
            f"the coordinator ranks could not link: {str(exc).splitlines()[0]}\n"
            f"gloo links ranks over the interface GLOO_SOCKET_IFNAME names ({interface}): "
            "set it on every host to the interface of the link between the coordinator hosts"
        ) from None
    if ranks is None:
        return await CoordinatorRun(options, job).main()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun: a rank whose agent is gone (killed, or ended when the master's
        # went away) checkpoints and stops instead of waiting out the ranks' timeout.
        die_with_parent()
    try:
        return await CoordinatorRun(options.for_rank(ranks.rank), job, ranks).main()
    finally:
        ranks.close()


def launch_ranks(count: int, argv: list[str]) -> int:
    """``serve --ranks N``: N coordinator ranks of this same command on this host, as
    torchrun would start them, but meeting through a file and linked over loopback, so
    no rank opens a port beyond its own WebSocket one. Returns the worst exit code."""
    meeting = Path(tempfile.mkdtemp(prefix="cleave-ranks-")) / "rendezvous"
    procs = []
    for rank in range(count):
        env = {**os.environ, **rank_environment(rank, count, meeting)}
        # A rank whose launcher is killed outright checkpoints and stops rather than
        # training on alone.
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "coordinator", *argv], env=env, preexec_fn=die_with_parent
            )
        )

    def forward(sig: int, _frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    try:
        codes = [proc.wait() for proc in procs]
    finally:
        shutil.rmtree(meeting.parent, ignore_errors=True)
    return max(codes, key=abs)


def _without_ranks(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ranks":
            skip = True
        elif not arg.startswith("--ranks="):
            out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main())
