"""What ``cleave-coordinator serve`` was asked to do, checked before anything starts:
``ServeOptions`` (from the command line and its configuration file) and what each
coordinator rank makes of it."""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from common.gemm_speed import matmul_gflops
from common.job_about import JobAbout
from coordinator.plan.live import Planner
from coordinator.pool.core import CoreConfig
from coordinator.schedule.scheduler import SHARED_SLOT_FLOPS, SchedulerConfig
from coordinator.serve.server import ServerConfig
from coordinator.step.job import Job


@dataclass(frozen=True)
class ServeOptions:
    """What ``serve`` was asked to do, checked: building one raises SystemExit with a
    message that names the option, before any state is touched."""

    job: str
    steps: int
    host: str
    port: int
    public_host: str | None
    state_dir: Path
    ledger: str | None
    tls_cert: Path | None
    tls_key: Path | None
    metrics_out: Path | None
    checkpoint_every: int
    fresh: bool
    local_workers: int
    local_worker_threads: int | None
    min_workers: int
    min_offload_mflop: float
    min_offload_intensity: float | None  # None: auto (KeepHome.below)
    planner: Planner
    coordinator_gflops: float
    heartbeat_timeout: float
    speculate_after: float | None
    leave_for_faster: float | None
    join_token: str
    handshake_timeout: float
    # The job's public description, over the job's own (None: the job's).
    job_name: str | None = None
    job_description: str | None = None
    job_operator: str | None = None
    job_link: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        if args.steps < 0 or args.local_workers < 0:
            raise SystemExit("--steps and --local-workers must be >= 0")
        if args.speculate_after and args.speculate_after < 1:
            raise SystemExit("--speculate-after must be >= 1 (or 0 to turn copies off)")
        if args.leave_for_faster and args.leave_for_faster < 1:
            raise SystemExit("--leave-for-faster must be >= 1 (or 0 to turn it off)")
        if getattr(args, "ranks", 1) < 1:
            raise SystemExit("--ranks must be >= 1")
        if args.checkpoint_every < 1:
            raise SystemExit("--checkpoint-every must be >= 1")
        if args.min_workers is not None and args.min_workers < 1:
            raise SystemExit("--min-workers must be >= 1: tiles need someone to compute them")
        if (args.tls_cert is None) != (args.tls_key is None):
            raise SystemExit("--tls-cert and --tls-key go together: give both or neither")
        return cls(
            job=args.job,
            steps=args.steps,
            host=args.host,
            port=args.port,
            public_host=getattr(args, "public_host", None) or None,
            state_dir=args.state_dir,
            ledger=getattr(args, "ledger", None),
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            metrics_out=args.metrics_out,
            checkpoint_every=args.checkpoint_every,
            fresh=args.fresh,
            local_workers=args.local_workers,
            local_worker_threads=args.local_worker_threads,
            min_workers=args.min_workers or max(1, args.local_workers),
            min_offload_mflop=args.min_offload_mflop,
            min_offload_intensity=offload_intensity(args.min_offload_intensity),
            planner=Planner(args.planner),
            coordinator_gflops=coordinator_gflops(args.coordinator_gflops, args.local_workers),
            heartbeat_timeout=args.heartbeat_timeout,
            speculate_after=args.speculate_after or None,
            leave_for_faster=args.leave_for_faster or None,
            join_token=args.join_token,
            handshake_timeout=args.handshake_timeout,
            job_name=getattr(args, "job_name", None),
            job_description=getattr(args, "job_description", None),
            job_operator=getattr(args, "job_operator", None),
            job_link=getattr(args, "job_link", None),
        )

    def for_rank(self, rank: int) -> ServeOptions:
        """This rank's options: a state directory of its own inside STATE_DIR (which keeps
        the job's one key), a port of its own (the port plus the rank, unless the port is
        0: any free one), and only rank 0 writes --metrics-out (its records carry the
        global batch's loss)."""
        return replace(
            self,
            state_dir=self.state_dir / f"rank-{rank}",
            port=self.port + rank if self.port else 0,
            metrics_out=self.metrics_out if rank == 0 else None,
        )

    def about(self, job: Job) -> JobAbout:
        """What volunteers are shown about ``job``; SystemExit names what to change."""

        def pick(option: str | None, own: str) -> str:
            return own if option is None else option

        try:
            return JobAbout(
                name=pick(self.job_name, job.name),
                description=pick(self.job_description, job.description),
                operator=pick(self.job_operator, job.operator),
                link=pick(self.job_link, job.link),
                parameters=sum(p.numel() for p in job.model.parameters()),
            )
        except ValueError as exc:
            raise SystemExit(
                f"cannot show the job to volunteers: {exc} (set it with --job-name, "
                "--job-description, --job-operator or --job-link, or in the Job)"
            ) from None

    def tls_context(self) -> ssl.SSLContext | None:
        """A server context for ``--tls-cert``/``--tls-key``, or None for plain ws://."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(certfile=self.tls_cert, keyfile=self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise SystemExit(
                f"cannot load --tls-cert {self.tls_cert} / --tls-key {self.tls_key}: {exc}"
            ) from None
        return ctx

    def server_config(self) -> ServerConfig:
        return ServerConfig(
            handshake_timeout_s=self.handshake_timeout,
            join_token=self.join_token,
            core=CoreConfig(
                # Several heartbeats per timeout, so one late beat never drops a worker.
                heartbeat_interval_s=min(
                    CoreConfig.heartbeat_interval_s, self.heartbeat_timeout / 4
                ),
                scheduler=SchedulerConfig(
                    heartbeat_timeout_s=self.heartbeat_timeout,
                    speculate_after=self.speculate_after,
                    leave_for_faster=self.leave_for_faster,
                    slot_flops=SHARED_SLOT_FLOPS,
                ),
            ),
        )


def offload_intensity(value: str | float) -> float | None:
    """--min-offload-intensity as a number, or None for auto."""
    return _number_or_auto("--min-offload-intensity", value)


def coordinator_gflops(value: str, local_workers: int) -> float:
    """--coordinator-gflops as a number. auto measures this machine, unless local workers
    run here too: they already use its cores, and a share for the coordinator would
    compete with them while the planner counts both."""
    gflops = _number_or_auto("--coordinator-gflops", value)
    if gflops is not None:
        return gflops
    if local_workers:
        return 0.0
    # Its own generator: the global one is the job's (its initialisation, its dropout).
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 512, generator=generator), torch.randn(512, 512, generator=generator)
    return matmul_gflops(a, b, target_s=0.2)


def _number_or_auto(option: str, value: str | float) -> float | None:
    """An option that takes a number >= 0 or the word auto (None)."""
    if value == "auto":
        return None
    try:
        number = float(value)
    except ValueError:
        raise SystemExit(f"{option} must be a number or auto, not {value!r}") from None
    if not 0 <= number < float("inf"):
        raise SystemExit(f"{option} must be >= 0 and finite")
    return number
