"""``cleave-worker``: the headless worker.

Exit codes: 0 after a clean leave (SIGINT/SIGTERM) or ``--forget``, 2 for bad
arguments or an unusable config file, 3 when the coordinator's key changed (a person
must decide whether to trust the new key: ``--forget URL`` and join again).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from client_app import readings, thermal
from client_app.config import (
    MAX_WINDOW,
    PinStore,
    WorkerSettings,
    config_dir,
    load_identity,
)
from client_app.options import WorkerOptions
from client_app.policy import Schedule
from client_app.policy_runner import PolicyRunner
from client_app.worker import RunResult, WorkerCore
from common.errors import ConfigError
from common.signing import fingerprint

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_REFUSED = 3
TOKEN_ENV = "CLEAVE_JOIN_TOKEN"  # keeps the token out of `ps` listings

log = logging.getLogger("client_app.cli")

_N = TypeVar("_N", int, float)


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _in_range(parse: Callable[[str], _N], lo: _N, hi: _N) -> Callable[[str], _N]:
    """An argparse type: what ``parse`` (``_integer``, ``_number``) reads, in [lo, hi]."""

    def checked(text: str) -> _N:
        value = parse(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo:g}, {hi:g}], not {text}")
        return value

    return checked


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def _positive_float(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def _temperature_limit(text: str) -> float:
    value = _number(text)
    # The bounds WorkerSettings enforces: below 20 °C every machine is "hot", above
    # 120 °C the hardware has shut itself down long before.
    if not (value == 0 or 20 <= value <= 120):
        raise argparse.ArgumentTypeError(f"must be 0 (no limit) or in [20, 120], not {text}")
    return value


def _schedule(text: str) -> str:
    try:
        Schedule.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cleave-worker",
        description="Donate this machine's CPU/GPU time to a Cleave coordinator.",
    )
    _add_worker_flags(parser)
    _add_policy_flags(parser)
    _add_program_flags(parser)
    return parser


def _add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """Where to join and what to give: the flags that override settings.json."""
    parser.add_argument(
        "--coordinator",
        metavar="URL",
        help="coordinator WebSocket URL, e.g. ws://host:8765/ws (default: from settings.json)",
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        metavar="N",
        help="CPU threads for tiles (default: half the cores, or settings.json)",
    )
    parser.add_argument(
        "--cpu-percent",
        type=_in_range(_integer, 1, 100),
        metavar="P",
        help="compute at most P%% of the time, resting between tiles (1-100; default 100)",
    )
    parser.add_argument(
        "--ca-file",
        metavar="PEM",
        help="for wss:// URLs: also trust the certificate(s) in this PEM file "
        "(e.g. a coordinator's self-signed certificate)",
    )
    parser.add_argument(
        "--token",
        metavar="TOKEN",
        help="join token of a private pool (default: $CLEAVE_JOIN_TOKEN, or settings.json); "
        "only a proof of it is sent, never the token",
    )
    parser.add_argument("--no-gpu", action="store_true", help="compute on the CPU even with CUDA")
    parser.add_argument("--name", metavar="NAME", help="name shown to the coordinator's operator")
    parser.add_argument(
        "--memory-mb",
        type=_positive_int,
        metavar="MB",
        help="largest tile (operands + result) to accept; default min(1 GiB, 25%% of RAM)",
    )
    parser.add_argument(
        "--window",
        type=_in_range(_integer, 1, MAX_WINDOW),
        metavar="N",
        help="tiles to hold at once (default 2: one computing while the next arrives)",
    )


def _add_policy_flags(parser: argparse.ArgumentParser) -> None:
    policy = parser.add_argument_group("when to compute (saved choices apply unless overridden)")
    policy.add_argument(
        "--idle-only",
        action="store_true",
        help="compute only while nobody uses this machine (see --idle-threshold/--idle-minutes)",
    )
    policy.add_argument(
        "--idle-threshold",
        type=_in_range(_number, 0, 100),
        metavar="PERCENT",
        help="other programs' CPU below this counts as idle (default 25)",
    )
    policy.add_argument(
        "--idle-minutes",
        type=_positive_float,
        metavar="M",
        help="idle for this long before computing (default 5)",
    )
    policy.add_argument(
        "--schedule",
        type=_schedule,
        metavar="WINDOWS",
        help='compute only in these daily windows, e.g. "22:00-07:00,12:00-13:00"',
    )
    policy.add_argument(
        "--no-battery-pause",
        action="store_true",
        help="keep computing on battery (default: pause while unplugged)",
    )
    policy.add_argument(
        "--in-use-cpu-percent",
        type=_in_range(_integer, 0, 100),
        metavar="P",
        help="while someone uses this machine (see --idle-threshold/--idle-minutes), "
        "compute at most P%% of the time, never more than --cpu-percent "
        "(0-100; 0 pauses, like --idle-only; default 100)",
    )
    policy.add_argument(
        "--in-use-threads",
        type=_positive_int,
        metavar="N",
        help="while someone uses this machine, use at most N CPU threads, never more than "
        "--threads (default: --threads)",
    )
    policy.add_argument(
        "--max-cpu-temp",
        type=_temperature_limit,
        metavar="C",
        help="pause while the CPU is above C °C (20-120; 0: no limit, the default)",
    )
    policy.add_argument(
        "--max-gpu-temp",
        type=_temperature_limit,
        metavar="C",
        help="pause while the GPU computing tiles is above C °C (20-120; 0: no limit, "
        "the default; needs nvidia-ml-py)",
    )
    policy.add_argument(
        "--temp-hysteresis",
        type=_in_range(_number, 1, 30),
        metavar="C",
        help="after a temperature pause, resume C °C below the limit (1-30; default 5)",
    )


def _add_program_flags(parser: argparse.ArgumentParser) -> None:
    """How this program runs: pins, logging, reconnects."""
    parser.add_argument(
        "--forget",
        metavar="URL",
        help="remove the pinned key of this coordinator URL and exit",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="default INFO",
    )
    parser.add_argument(
        "--backoff-base",
        type=_positive_float,
        default=0.5,
        metavar="SECONDS",
        help="first reconnect delay ceiling; doubles per failure up to 30 s (default 0.5)",
    )


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    # websockets logs every frame at DEBUG: far too much next to per-tile lines.
    logging.getLogger("websockets").setLevel(max(logging.getLevelName(level), logging.INFO))


def _settings_from_args(args: argparse.Namespace, saved: WorkerSettings) -> WorkerSettings:
    settings = saved
    if args.coordinator:
        settings = replace(settings, coordinator_url=args.coordinator)
    if args.threads:
        settings = replace(settings, threads=args.threads)
    if args.cpu_percent:
        settings = replace(settings, cpu_percent=args.cpu_percent)
    if args.no_gpu:
        settings = replace(settings, use_gpu=False)
    if args.name:
        settings = replace(settings, name=args.name)
    if args.memory_mb:
        settings = replace(settings, memory_mb=args.memory_mb)
    if args.window:
        settings = replace(settings, window=args.window)
    if args.idle_only:
        settings = replace(settings, idle_only=True)
    if args.idle_threshold is not None:  # 0 is a valid (strict) threshold
        settings = replace(settings, idle_threshold_percent=args.idle_threshold)
    if args.idle_minutes:
        settings = replace(settings, idle_minutes=args.idle_minutes)
    if args.schedule is not None:  # "" clears a saved schedule
        settings = replace(settings, schedule=args.schedule)
    if args.no_battery_pause:
        settings = replace(settings, pause_on_battery=False)
    if args.in_use_cpu_percent is not None:  # 0 is valid: pause while in use
        settings = replace(settings, in_use_cpu_percent=args.in_use_cpu_percent)
    if args.in_use_threads:
        settings = replace(settings, in_use_threads=args.in_use_threads)
    if args.max_cpu_temp is not None:  # 0 clears a saved limit
        settings = replace(settings, max_cpu_temp_c=args.max_cpu_temp)
    if args.max_gpu_temp is not None:
        settings = replace(settings, max_gpu_temp_c=args.max_gpu_temp)
    if args.temp_hysteresis is not None:
        settings = replace(settings, temp_hysteresis_c=args.temp_hysteresis)
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV)
    if token is not None:
        settings = replace(settings, join_token=token)
    return settings


SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _default_handler(sig: int) -> Any:
    return signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL


async def _run(core: WorkerCore, policy: PolicyRunner | None = None) -> RunResult:
    loop = asyncio.get_running_loop()
    # Signals reach only the main thread; an app that runs main() in another thread
    # routes them itself (e.g. to core.stop()).
    handle_signals = threading.current_thread() is threading.main_thread()

    def on_signal() -> None:
        log.info("stopping (press Ctrl-C again to quit at once)")
        core.stop()
        # A second signal gets Python's default handling: an immediate KeyboardInterrupt.
        for sig in SIGNALS:
            if sys.platform == "win32":
                signal.signal(sig, _default_handler(sig))
            else:
                loop.remove_signal_handler(sig)

    for sig in SIGNALS if handle_signals else ():
        if sys.platform == "win32":  # Windows event loops have no add_signal_handler
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(on_signal))
        else:
            loop.add_signal_handler(sig, on_signal)
    # The policy ticks next to the core on this loop and outlives nothing: it stops
    # when the core has left.
    policy_task = asyncio.ensure_future(policy.run()) if policy is not None else None
    try:
        return await core.run()
    finally:
        if policy is not None and policy_task is not None:
            policy.stop()
            policy_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await policy_task


def _describe_policy(settings: WorkerSettings) -> str:
    rules = []
    if settings.idle_only:
        rules.append(
            f"only when idle (others' CPU < {settings.idle_threshold_percent:g}% "
            f"for {settings.idle_minutes:g} min)"
        )
    if settings.schedule:
        rules.append(f"schedule {settings.schedule}")
    rules.append("pause on battery" if settings.pause_on_battery else "also on battery")
    if settings.in_use_cpu_percent == 0:
        if not settings.idle_only:
            rules.append("paused while in use")
    elif (settings.in_use_cpu_percent, settings.effective_in_use_threads) != (
        settings.cpu_percent,
        settings.effective_threads,
    ):
        threads = settings.effective_in_use_threads
        rules.append(
            f"while in use {settings.in_use_cpu_percent}% of the time, "
            f"{threads} thread{'' if threads == 1 else 's'}"
        )
    for part, limit in (("CPU", settings.max_cpu_temp_c), ("GPU", settings.max_gpu_temp_c)):
        if limit and (part == "CPU" or settings.use_gpu):
            resume = limit - settings.temp_hysteresis_c
            rules.append(f"pause above {limit:g} °C {part} (resume at {resume:g} °C)")
    if settings.snooze_until:
        rules.append(f"snoozed until {settings.snooze_until}")
    return ", ".join(rules)


def _warn_unusable_temperature_limits(
    settings: WorkerSettings, sampler: readings.Sampler, *, gpu_present: bool
) -> None:
    """Once at start: a limit without a sensor would otherwise be silently ignored."""
    if settings.max_cpu_temp_c and sampler.cpu_temp is None:
        log.warning(
            "the CPU temperature limit (%g °C) cannot apply: %s",
            settings.max_cpu_temp_c,
            thermal.cpu_sensor_missing(None),
        )
    if settings.max_gpu_temp_c and settings.use_gpu and sampler.gpu_temp is None:
        log.warning(
            "the GPU temperature limit (%g °C) cannot apply: %s",
            settings.max_gpu_temp_c,
            thermal.gpu_sensor_missing(None, gpu_present),
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.log_level)
    directory = config_dir()
    pins = PinStore.in_dir(directory)
    try:
        if args.forget:
            if pins.forget(args.forget):
                log.info("forgot the pinned key of %s; its next key will be pinned", args.forget)
            else:
                log.info("no key was pinned for %s (pins: %s)", args.forget, pins.path)
            return EXIT_OK
        saved = WorkerSettings.load(directory)
        settings = _settings_from_args(args, saved)
        if not saved.name and not args.name:
            # A stable name lets the operator recognise this machine across restarts.
            named = saved.with_name()
            named.save(directory)
            settings = replace(settings, name=named.name)
        pins.load()  # a corrupt pin file should stop us now, not at the first welcome
        identity = load_identity(directory)
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    except ValueError as exc:  # e.g. a --name longer than the settings allow
        parser.error(str(exc))
    if not settings.coordinator_url:
        parser.error("--coordinator URL is required (none saved in settings.json)")
    try:
        options = WorkerOptions(
            identity=identity, ca_file=args.ca_file, backoff_base_s=args.backoff_base
        )
        core = WorkerCore(settings, pin_check=pins.check, options=options)
    except ValueError as exc:
        parser.error(str(exc))
    log.info("worker identity (key fingerprint): %s", fingerprint(identity))
    log.info(
        "worker %r joining %s (threads=%d, gpu=%s, window=%d; config in %s)",
        settings.name,
        settings.coordinator_url,
        settings.effective_threads,
        "allowed" if settings.use_gpu else "off",
        settings.window,
        directory,
    )
    sampler = readings.shared_sampler()
    _warn_unusable_temperature_limits(
        settings, sampler, gpu_present=core.computer.device.type == "cuda"
    )
    policy = PolicyRunner(core, settings, sample=sampler)
    log.info("policy: %s", _describe_policy(settings))
    result = asyncio.run(_run(core, policy))
    if result is RunResult.REFUSED:
        log.error("not working for %s: %s", settings.coordinator_url, core.status.detail)
        return EXIT_REFUSED
    return EXIT_OK
