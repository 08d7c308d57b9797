"""One ``cleave-coordinator serve`` run: validated options, then start, wait for workers,
train, shut down, each its own step.

``cli.py`` parses the command line into ``ServeOptions`` (``serve_options.py``: every
check happens there, before anything is created); ``CoordinatorRun`` composes the parts
(ledger, server, local workers, offload, trainer) and owns their order: a checkpoint
always lands before the workers go and the server closes, whatever ends the run.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.messages import JobState
from common.signing import fingerprint, load_or_create_private_key
from coordinator.plan.keep_home import CPU_S_PER_BYTE, KeepHome
from coordinator.plan.live import LivePlanning, Planner
from coordinator.plan.planner import plan_config_for
from coordinator.pool.front_door import FrontDoor
from coordinator.pool.ledger import Ledger
from coordinator.serve.gc_policy import settle_after_start
from coordinator.serve.local_workers import LocalWorkers
from coordinator.serve.offload import TileOffload
from coordinator.serve.rank_view import RankView
from coordinator.serve.server import WS_PATH, CoordinatorServer
from coordinator.serve_options import ServeOptions
from coordinator.step.executor import StepCancelled
from coordinator.step.flops import describe
from coordinator.step.job import Job, JobError
from coordinator.step.progress import Progress
from coordinator.step.ranks import BatchSplitError, Ranks
from coordinator.step.run_state import RunState
from coordinator.step.torch_threads import orchestrate_on_one_thread
from coordinator.step.trainer import PoolCounters, StepRecord, Trainer
from coordinator.structured_log import PROGRESS_LOGGER

log = logging.getLogger("cleave.coordinator")
progress_log = logging.getLogger(PROGRESS_LOGGER)
# Stopped by a signal, after the checkpoint: the shell's convention, 128 + signal number.
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143
ANY_ADDRESS = ("0.0.0.0", "::", "")


# How often training looks whether its local workers are all gone.
LOCAL_WORKERS_WATCH_S = 1.0


class RunAborted(Exception):
    """The run cannot go on; the message says why and what to look at."""


def say(text: str, **fields: Any) -> None:
    """Progress for the operator: a plain line on stdout, or a JSON record with ``fields``."""
    progress_log.info(text, extra=fields)


class CoordinatorRun:
    """The parts of one run, in the order they start and stop."""

    def __init__(self, options: ServeOptions, job: Job, ranks: Ranks | None = None) -> None:
        self.options = options
        self.job = job
        self.ranks = ranks  # the coordinator ranks this one trains with, if any
        self.about = options.about(job)
        self.ssl_context = options.tls_context()
        self._told: JobState | None = None
        self.progress = Progress(options.steps, on_change=self._tell_workers)
        self.cancel = threading.Event()
        self.stop_signal: signal.Signals | None = None
        self.in_trainer = False  # the training thread runs: it must finish before we stop
        self.aborted: str | None = None  # why the run stopped itself mid-training, if it did
        state = options.state_dir
        state.mkdir(parents=True, exist_ok=True)
        self.key = self._job_key(state)
        self.rank_view: RankView | None = None  # with other ranks: all of them, once started
        self._view_task: asyncio.Future[None] | None = None
        self.ledger = open_ledger(
            options.ledger or state / "ledger.sqlite",
            # Each rank runs the same steps on its own slice: each pays for its own tiles.
            scope=f"rank-{ranks.rank}" if ranks is not None else "",
        )
        self.server = CoordinatorServer(
            key=self.key,
            job_name=self.about.name,
            about=self.about,
            ledger=self.ledger,
            config=options.server_config(),
            status_extra=self._status_extra,
        )
        self.url = ""
        self._training: asyncio.Future[None] | None = None
        self._tell_workers(self.progress)

    def _job_key(self, state: Path) -> Ed25519PrivateKey:
        """The key this coordinator signs with. Ranks of one job share one, in the state
        directory above theirs: rank 0 makes it if missing, the others wait for it, so a
        worker that pinned the job's key may serve any rank."""
        if self.ranks is None:
            return load_or_create_private_key(state / "coordinator.key")
        shared = state.parent / "coordinator.key"
        if self.ranks.rank == 0:
            load_or_create_private_key(shared)
        self.ranks.barrier()
        if not shared.exists():
            raise SystemExit(
                f"rank {self.ranks.rank}: {shared} is missing. Copy rank 0's key there on "
                "every host, so that all ranks speak for one job key"
            )
        return load_or_create_private_key(shared)

    def _status_extra(self) -> dict[str, Any]:
        """What /api/status adds to the server's own: the run's progress and, with other
        ranks, every rank's summary."""
        view = self.rank_view
        return {**self.progress.status(), **(view.status() if view is not None else {})}

    def _rank_summary(self) -> dict[str, Any]:
        """What the other ranks are told of this one: read from memory, not the whole
        /api/status (every worker and ledger row) that a rank with many workers would
        build on the event loop."""
        progress = self.progress.status()
        history = progress["history"]
        return {
            "state": progress["state"],
            "step": progress["step"],
            "workers": len(self.server.core.workers),
            "tiles_verified": self.server.core.counters.tiles_verified,
            "last": history[-1] if history else {},
        }

    def _tell_workers(self, progress: Progress) -> None:
        """Keep the workers' JobState in step with the run (any thread)."""
        state = JobState(step=progress.step, steps=self.options.steps, note=progress.note())
        if state == self._told:
            return
        self._told = state
        self.server.set_job_state(state)

    @property
    def checkpoint(self) -> Path:
        return self.options.state_dir / "checkpoint.pt"

    async def main(self) -> int:
        await self.start()
        trainer = self._trainer()
        local = self._local_workers()
        await self._resume(trainer)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        local.start()
        self._training = asyncio.ensure_future(self.train(trainer, local))
        failed: str | None = None
        try:
            await self._training
        except (RunAborted, BatchSplitError) as exc:
            failed = str(exc)
        except JobError as exc:  # the job's own mistake: its message says what to change
            failed = f"training failed: {exc}"
        except (asyncio.CancelledError, Exception) as exc:
            if self.stop_signal is None:
                log.exception("training failed")
                failed = f"training failed: {type(exc).__name__}: {exc}"
        finally:
            await self.shutdown(trainer, local, failed)
        return self._exit_code(failed)

    async def start(self) -> None:
        """Listen, and say where."""
        options = self.options
        port = await self.server.start(options.host, options.port, ssl_context=self.ssl_context)
        settle_after_start()
        connect_host = "127.0.0.1" if options.host in ANY_ADDRESS else options.host
        ws, http = ("wss", "https") if self.ssl_context is not None else ("ws", "http")
        public = public_url(options.host, options.public_host, port, tls=ws == "wss")
        self.url = f"{ws}://{connect_host}:{port}{WS_PATH}"
        name = self.about.name
        say(f"Cleave coordinator for job {name!r} on {self.url}", url=self.url, job=name)
        say(f"  dashboard:       {http}://{connect_host}:{port}/")
        say(f"  status:          {http}://{connect_host}:{port}/api/status")
        say(f"  metrics:         {http}://{connect_host}:{port}/metrics")
        say(f"  key fingerprint: {fingerprint(self.key)}")
        if self.ranks is not None:
            say(
                f"  rank:            {self.ranks.rank} of {self.ranks.world} coordinator ranks"
                f" (this one trains on 1/{self.ranks.world} of each batch)"
            )
            self.server.rank, self.server.ranks = self.ranks.rank, self.ranks.world
            if not public:
                say(
                    "  front door:      no worker is sent to this rank: it listens on every "
                    "address; give --public-host, the one workers use"
                )
            if self.ranks.store is not None:
                view = self.rank_view = RankView(self.ranks, public, self._rank_summary)
                self._view_task = asyncio.ensure_future(view.run())
                door = FrontDoor(self.ranks.rank)
                core = self.server.core
                self.server.front_door = lambda hello: door.direct(
                    len(core.workers), view.loads(), view.clock()
                )
        if options.planner is Planner.GRID:
            say("  planner:         grid (about two tiles per worker)")
        elif options.coordinator_gflops:
            say(
                "  planner:         cost model; this machine computes a share "
                f"({options.coordinator_gflops:.0f} GFLOP/s)"
            )
        else:
            say("  planner:         cost model; every tile goes to workers")
        if options.host in ANY_ADDRESS:
            shown = public or f"{ws}://THIS-HOST:{port}{WS_PATH}"
            say(f"  connect a worker: cleave-worker --coordinator {shown}")
            say(f"  (local workers use {self.url})")
        else:
            say(f"  connect a worker: cleave-worker --coordinator {self.url}")

    def _local_workers(self) -> LocalWorkers:
        options = self.options
        return LocalWorkers(
            options.local_workers,
            self.url,
            options.state_dir,
            options.local_worker_threads,
            # They connect to 127.0.0.1 or the --host name: the certificate must name it.
            ca_file=options.tls_cert.resolve()
            if self.ssl_context is not None and options.tls_cert is not None
            else None,
        )

    def _trainer(self) -> Trainer:
        options, server = self.options, self.server
        offload = TileOffload(
            server,
            asyncio.get_running_loop(),
            self.key,
            plan_config_for(options.min_offload_mflop),
            LivePlanning(
                cost_model=options.planner is Planner.COST,
                coordinator_flops_per_s=options.coordinator_gflops * 1e9,
                cpu_s_per_byte=CPU_S_PER_BYTE,
            ),
            KeepHome(below=options.min_offload_intensity),
        )
        return Trainer(
            self.job,
            offload,
            # Plain ints and an immutable snapshot: safe to read from the training thread.
            pool_counters=lambda: PoolCounters(
                server.counters.tiles_verified,
                server.counters.reissued,
                server.pool.workers,
                server.counters.flops_computed_here,
                server.counters.compute_s,
                server.counters.bytes_down,
                server.counters.bytes_up,
            ),
            metrics_out=options.metrics_out,
            cancel=self.cancel,
            checkpoint_path=self.checkpoint,
            checkpoint_every=options.checkpoint_every,
            ranks=self.ranks,
            on_checkpoint=self.ledger.checkpointed,
        )

    async def _resume(self, trainer: Trainer) -> None:
        """Resume from the state directory's checkpoint (or start over with --fresh)."""
        if self.options.fresh:
            self.checkpoint.unlink(missing_ok=True)
            self.ledger.start_over()
        try:
            resumed = trainer.resume()
        except Exception as exc:
            await self.server.close()
            self.ledger.close()
            raise SystemExit(
                f"cannot resume from {self.checkpoint} ({type(exc).__name__}: {exc}); "
                "is it from another job? Move it away to start over."
            ) from None
        steps = self.options.steps
        if resumed:
            say(f"resuming from step {trainer.step} of {steps}")
            if trainer.step >= steps:
                say(
                    f"this state directory has already trained {trainer.step} steps: raise "
                    "--steps to go on, or pass --fresh to start over"
                )
        self.progress.step = trainer.step
        self.progress.checkpoint_step = trainer.checkpointed_step

    async def wait_for_workers(self, local: LocalWorkers) -> None:
        server, wanted = self.server, self.options.min_workers
        self.progress.state = RunState.WAITING
        waited = time.monotonic()
        while server.pool.active < wanted:
            if local.count and local.all_exited():
                raise RunAborted(
                    f"all {local.count} local workers exited before training could start; "
                    f"their logs are in {local.dir}"
                )
            say(f"waiting for workers: {server.pool.active}/{wanted} connected")
            try:
                await asyncio.wait_for(server.wait_for_workers(wanted), 10)
            except asyncio.TimeoutError:
                continue
        active, waited_s = server.pool.active, time.monotonic() - waited
        log.info("%d worker%s after %.1f s", active, "" if active == 1 else "s", waited_s)

    async def train(self, trainer: Trainer, local: LocalWorkers) -> None:
        await self.wait_for_workers(local)
        # --steps is the total: after a resume, only the steps still missing are trained.
        steps = max(0, self.options.steps - trainer.step)
        log.info("training %d steps", steps)
        self.progress.state = RunState.TRAINING
        if self.cancel.is_set():
            return
        self.in_trainer = True  # no await since the check above: no signal slipped between

        def on_step(record: StepRecord) -> None:  # on the training thread
            self.progress.add(
                record, trainer.dag.get("gflop"), trainer.checkpointed_step, trainer.flops
            )
            scheduled = self.job.lr_scheduler is not None and record.lr is not None
            say(
                f"step {record.step:4d}  loss {record.loss:.4f}  {record.seconds:6.2f} s  "
                f"tiles {record.tiles:4d}  reissued {record.reissued:3d}  "
                f"workers {record.workers}" + (f"  lr {record.lr:.3g}" if scheduled else ""),
                event="step",
                **asdict(record),
            )

        def train() -> None:
            orchestrate_on_one_thread()  # coordinator.step.torch_threads says why
            trainer.run(steps, on_step)

        watch = asyncio.ensure_future(self._watch_local_workers(local))
        try:
            await asyncio.to_thread(train)
        except StepCancelled:
            if self.aborted is not None:  # the step in flight was abandoned, as on a signal
                raise RunAborted(self.aborted) from None
            raise
        finally:
            watch.cancel()
        self.progress.state = RunState.DONE

    async def _watch_local_workers(self, local: LocalWorkers) -> None:
        """Stop the run once every local worker has exited (banned, or crashed) while no
        other worker is connected: the step's tiles would wait for workers forever, and a
        banned key cannot come back. The last completed step is checkpointed first."""
        if not local.count:
            return
        while not (local.all_exited() and self.server.pool.active == 0):
            await asyncio.sleep(LOCAL_WORKERS_WATCH_S)
        self.aborted = (
            f"all {local.count} local workers exited during training and no other worker is "
            f"connected, so the step's tiles would wait forever; their logs are in {local.dir} "
            "(a banned worker's reason is in the log above)"
        )
        log.error("%s: stopping", self.aborted)
        self.cancel.set()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stop_signal is not None:
            log.warning("%s again: still stopping (checkpoint first)", sig.name)
            return
        self.stop_signal = sig
        self.progress.state = RunState.STOPPING
        log.info("%s: stopping; the last completed step is checkpointed first", sig.name)
        self.cancel.set()
        # Waiting for workers is safe to cut short; a running step notices ``cancel``.
        if not self.in_trainer and self._training is not None and not self._training.done():
            self._training.cancel()

    async def shutdown(self, trainer: Trainer, local: LocalWorkers, failed: str | None) -> None:
        """The training thread has returned and trainer.run has checkpointed the last
        completed step; only now do the workers go and the server close."""
        self.cancel.set()
        progress = self.progress
        if trainer.checkpointed_step is not None:
            progress.checkpoint_step = trainer.checkpointed_step
            say(
                f"checkpoint: step {trainer.checkpointed_step} in {self.checkpoint}",
                event="checkpoint",
                step=trainer.checkpointed_step,
            )
        progress.state = (
            RunState.FAILED if failed else RunState.STOPPED if self.stop_signal else progress.state
        )
        await asyncio.to_thread(local.stop)
        if self._view_task is not None:
            self._view_task.cancel()
        await self.server.close()
        say_traffic(self.server)
        if trainer.flops:
            say(f"FLOPs of the last step: {describe(trainer.flops)}", flops=trainer.flops)
        say_contributions(self.ledger)
        self.ledger.close()

    def _exit_code(self, failed: str | None) -> int:
        if failed is not None:
            say(f"error: {failed}")
            return 1
        if self.stop_signal is not None:
            name = self.stop_signal.name
            say(f"stopped by {name}", event="stopped", signal=name)
            return EXIT_TERMINATED if self.stop_signal == signal.SIGTERM else EXIT_INTERRUPTED
        return 0


def say_traffic(server: CoordinatorServer) -> None:
    counters = server.counters
    if not counters.tiles_sent:
        return
    down, uncached = counters.bytes_down, counters.bytes_down_uncached
    saved = max(0.0, 1 - down / uncached) if uncached else 0.0
    say(
        f"\ntraffic this run: {down / 1e6:.1f} MB to workers ({uncached / 1e6:.1f} MB without "
        f"their operand caches: {saved:.0%} saved), {counters.bytes_up / 1e6:.1f} MB back"
    )
    if counters.bytes_half:
        say(
            f"bf16/fp16 tiles: {counters.bytes_half / 1e6:.1f} MB of that traffic; as fp32 "
            f"they would have been {2 * counters.bytes_half / 1e6:.1f} MB "
            f"({counters.bytes_half / 1e6:.1f} MB saved)"
        )
    if counters.kept_here:
        say(
            f"tiles: {counters.tiles_verified} verified from workers, {counters.kept_here} "
            "computed here (the planner's share for the coordinator)"
        )


def public_url(host: str, public_host: str | None, port: int, *, tls: bool) -> str:
    """The URL workers reach this coordinator at, or "" when it is not known (listening
    on every address with no --public-host)."""
    if public_host:
        host = public_host
    elif host in ANY_ADDRESS:
        return ""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"{'wss' if tls else 'ws'}://{host}:{port}{WS_PATH}"


def open_ledger(where: str | Path, *, scope: str = "") -> Ledger:
    """The ledger at ``where``, or SystemExit saying why it cannot be opened (a
    PostgreSQL URL's password is not repeated)."""
    try:
        return Ledger(where, scope=scope)
    except Exception as exc:  # sqlite3, psycopg and OS errors alike: none is the user's bug
        shown = re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", str(where))
        text = re.sub(r"password=\S+", "password=***", str(exc).strip().splitlines()[0])
        raise SystemExit(f"cannot open the ledger at {shown}: {text}") from exc


def say_contributions(ledger: Ledger) -> None:
    rows = ledger.all()
    if not rows:
        return
    say("\ncontributions (verified, all time; workers are known by their key):")
    say(
        f"  {'worker':<20} {'key':<9} {'tiles':>7} {'GFLOP':>9} {'MB down':>9} {'MB up':>8} "
        f"{'rejected':>8} {'reputation':>10}"
    )
    for c in rows:
        standing = "BANNED" if c.banned_reason else f"{c.reputation:.2f}"
        say(
            f"  {c.name[:20]:<20} {c.key_fingerprint[:9]:<9} {c.tiles:>7} {c.gflop:>9.2f} "
            f"{c.bytes_down / 1e6:>9.1f} {c.bytes_up / 1e6:>8.1f} {c.rejected:>8} {standing:>10}"
        )
