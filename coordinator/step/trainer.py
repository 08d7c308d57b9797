"""The training loop at the coordinator: trace, run the step as dataflow, apply the optimizer.

The GEMMs of each step go to workers through the offload; gradients come back into
``param.grad`` and the user's own optimizer takes the step here, so any torch optimizer
works unchanged.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from common.atomic_file import recover_recycling
from coordinator.step.checkpoint import Checkpoint, load_checkpoint
from coordinator.step.checkpoint_writer import CheckpointWriter, take_snapshot
from coordinator.step.cpu_costs import COMPUTING_STAGES, COSTS, process_cpu_seconds, since
from coordinator.step.eager import run_eager_step
from coordinator.step.executor import DataflowExecutor, GemmOffload, StepCancelled
from coordinator.step.flops import describe
from coordinator.step.gemm_names import step_label
from coordinator.step.heap import StepTrims
from coordinator.step.job import Job
from coordinator.step.ranks import Ranks
from coordinator.step.tracing import StepTracer, dag_summary, gemm_dag

log = logging.getLogger("cleave.coordinator")


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    seconds: float
    tiles: int  # tiles verified during this step
    reissued: int  # tiles re-issued during this step (lost, refused or failed)
    workers: int  # workers connected at the end of the step
    gemms_offloaded: int
    gemms_local: int
    # Of every op's FLOPs in this step (torch.utils.flop_counter conventions), the share
    # that workers computed; None for a step without FLOPs to count.
    workers_flop_share: float | None = None
    workers_flops: int = 0  # those FLOPs (what the ledger credits for this step)
    captured: bool = True  # False: the step ran eagerly (it cannot be one graph)
    # GEMM seconds the workers reported for this step's verified tiles.
    worker_compute_s: float = 0.0
    # The coordinator's CPU seconds in this step, by stage and by thread (cpu_costs),
    # its checkpoint included.
    cpu: dict[str, float] | None = None
    # Seconds the training thread spent on checkpoints in this step: waiting at the
    # optimizer step for the previous write, if it was still in flight (also part of
    # ``seconds``), and taking the snapshot after the step (0 when none was due). The
    # snapshot's CPU is ``cpu["checkpoint"]``; the write runs on a thread of its own
    # (coordinator.step.checkpoint_writer) and its CPU is ``cpu["checkpoint_write"]`` of
    # the steps it ran beside.
    checkpoint_s: float = 0.0
    # CPU seconds of the coordinator's whole process in this step (every thread, the
    # checkpoint's write included; local workers are processes of their own), and of
    # that, what orchestrating the step cost: all of it but the tiles the coordinator
    # multiplied itself (the planner's share and stranded tiles), which are computing,
    # not handing out. Over eager torch's CPU for the same step this is the
    # orchestration ratio (bench/bench_step.py).
    process_cpu_s: float = 0.0
    orchestration_cpu_s: float = 0.0
    # Tile bytes sent to workers and results received in this step, and the bytes of
    # the operand blocks cut and hashed for it (each block once, however often sent).
    bytes_down: int = 0
    bytes_up: int = 0
    bytes_cut: int = 0
    # The learning rate this step's update used (the optimizer's first parameter group):
    # it moves with the job's lr_scheduler.
    lr: float | None = None


# Step records ``Trainer.run`` returns at most: the latest steps'. A long run's records
# go to its ``on_step`` as they come (the served run's log, metrics and status).
KEPT_RECORDS = 1000


@dataclass(frozen=True)
class PoolCounters:
    tiles_verified: int
    reissued: int
    workers: int
    flops_computed_here: int = 0  # offloaded tiles the server computed itself (stranded)
    compute_s: float = 0.0  # GEMM seconds workers reported for their verified tiles
    bytes_down: int = 0  # tile bytes sent to workers
    bytes_up: int = 0  # result bytes received


class Trainer:
    def __init__(
        self,
        job: Job,
        offload: GemmOffload | None,
        *,
        pool_counters: Callable[[], PoolCounters] = lambda: PoolCounters(0, 0, 0),
        metrics_out: Path | None = None,
        cancel: threading.Event | None = None,
        checkpoint_path: Path | None = None,
        checkpoint_every: int = 1,
        ranks: Ranks | None = None,
        on_checkpoint: Callable[[int], None] = lambda step: None,
    ) -> None:
        """``on_checkpoint(step)``: a checkpoint of ``step`` completed steps is complete
        (written, on the writer's thread, or resumed from)."""
        if checkpoint_every < 1:
            raise ValueError("checkpoint_every must be >= 1")
        self.job = job
        self.offload = offload
        self.ranks = ranks  # other coordinator ranks training the same model, if any
        self.executor = DataflowExecutor(offload)
        self.tracer = StepTracer(job)
        self.pool_counters = pool_counters
        self.metrics_out = metrics_out
        self.cancel = cancel or threading.Event()
        self.checkpoint_path = checkpoint_path
        self.checkpoint_every = checkpoint_every
        self.on_checkpoint = on_checkpoint
        self._writer = (
            CheckpointWriter(checkpoint_path, on_checkpoint)
            if checkpoint_path is not None
            else None
        )
        self._heap = StepTrims()
        self.step = 0
        self.batches_consumed = 0
        self._checkpointed_step = -1
        # Data position and RNG at the start of the step in progress: a step abandoned
        # half-way has consumed a batch (and maybe random numbers), yet a checkpoint
        # written after it must describe the last step boundary. None between steps.
        self._step_start: tuple[int, torch.Tensor] | None = None
        self.losses: list[float] = []
        self.dag: dict[str, Any] = {}
        # The last step's FLOP accounting (coordinator.step.flops.FlopTally.summary()).
        self.flops: dict[str, Any] = {}

    def resume(self) -> bool:
        """Load the checkpoint, if there is one: model, optimizer, RNG, data position and
        step counter. True if training resumes from it."""
        if self.checkpoint_path is None:
            return False
        for torn in recover_recycling(self.checkpoint_path):
            log.info("discarded %s: a checkpoint write that was cut short", torn.name)
        ckpt = load_checkpoint(self.checkpoint_path)
        if self.ranks is not None:
            ckpt = self.ranks.newest_checkpoint(ckpt)
        if ckpt is None:
            return False
        self.job.model.load_state_dict(ckpt.model)
        self.job.optimizer.load_state_dict(ckpt.optimizer)
        self._resume_schedule(ckpt)
        for _ in range(ckpt.batches_consumed):  # fast-forward the data to where it was
            self.job.next_batch()
        self.batches_consumed = ckpt.batches_consumed
        self.step = self._checkpointed_step = ckpt.step
        torch.set_rng_state(ckpt.rng_state)
        self.on_checkpoint(ckpt.step)
        log.info("resuming from step %d (checkpoint %s)", ckpt.step, self.checkpoint_path)
        return True

    def _resume_schedule(self, ckpt: Checkpoint) -> None:
        """The learning-rate schedule where the checkpoint left it. The optimizer's
        state already holds the learning rate of that step."""
        scheduler = self.job.lr_scheduler
        if scheduler is not None and ckpt.scheduler is not None:
            scheduler.load_state_dict(ckpt.scheduler)
        elif scheduler is not None:
            log.warning(
                "the checkpoint holds no learning-rate schedule (it was written by a job "
                "without one): the job's lr_scheduler starts from its beginning at step %d",
                ckpt.step,
            )
        elif ckpt.scheduler is not None:
            log.warning(
                "the checkpoint was written by a job with an lr_scheduler and this job has "
                "none: the learning rate stays at the checkpoint's"
            )

    @property
    def checkpointed_step(self) -> int | None:
        """The step of the last complete checkpoint, written or resumed from, if any."""
        if self._writer is not None and (written := self._writer.written_step) is not None:
            return written
        return self._checkpointed_step if self._checkpointed_step >= 0 else None

    def save_checkpoint(self) -> None:
        """Checkpoint the last completed step (not a step abandoned half-way) and wait
        until it is on disk."""
        self._start_checkpoint()
        if self._writer is not None:
            self._writer.wait()

    def close(self) -> None:
        """Finish the checkpoint write in flight and end the writer's thread."""
        if self._writer is not None:
            self._writer.close()

    def _start_checkpoint(self) -> None:
        """Snapshot the last completed step and hand it to the writer."""
        if self._writer is None or self._checkpointed_step == self.step:
            return
        batches_consumed, rng_state = self._step_start or (
            self.batches_consumed,
            torch.get_rng_state(),
        )
        self._writer.submit(
            take_snapshot(
                self.job.model,
                self.job.optimizer,
                step=self.step,
                batches_consumed=batches_consumed,
                rng_state=rng_state,
                lr_scheduler=self.job.lr_scheduler,
            )
        )
        self._checkpointed_step = self.step

    def run(
        self, steps: int, on_step: Callable[[StepRecord], None] | None = None
    ) -> list[StepRecord]:
        """Train ``steps`` more steps; checkpoint every ``checkpoint_every`` and at the end.
        Returns the records of the last ``KEPT_RECORDS`` steps: ``on_step`` gets each
        one as it comes, and a run of a million steps would otherwise hold them all.

        When ``cancel`` is set the step in progress is abandoned, the last completed step
        is checkpointed (a stop loses no finished work) and ``StepCancelled`` raised."""
        records: deque[StepRecord] = deque(maxlen=KEPT_RECORDS)
        try:
            self._run_steps(steps, records, on_step)
        finally:
            self.close()
        return list(records)

    def _run_steps(
        self,
        steps: int,
        records: deque[StepRecord],
        on_step: Callable[[StepRecord], None] | None,
    ) -> None:
        for _ in range(steps):
            try:
                if self.cancel.is_set():
                    raise StepCancelled("cancelled between steps")
                record = self.train_step()
            except StopIteration:
                log.info(
                    "the job's batches ran out after %d step%s",
                    self.step,
                    "" if self.step == 1 else "s",
                )
                break
            except StepCancelled:
                log.info("stopping at step %d: checkpointing the steps completed", self.step)
                self.save_checkpoint()
                raise
            records.append(record)
            if on_step is not None:
                on_step(record)
        self.save_checkpoint()  # a clean end: nothing is lost whatever N is

    def train_step(self) -> StepRecord:
        COSTS.this_thread_is("training")
        self._step_start = (self.batches_consumed, torch.get_rng_state())
        inputs, targets = self.job.next_batch()
        if self.ranks is not None:  # this rank's rows of the global batch
            inputs, targets = self.ranks.slice((inputs, targets))
        self.batches_consumed += 1
        started = time.perf_counter()
        before = self.pool_counters()
        cpu_before = COSTS.snapshot()
        process_before = process_cpu_seconds()
        cut_before = COSTS.bytes_so_far("cut")
        traced = self.tracer.get(inputs, targets)
        if traced is not None and not self.dag:
            self.dag = dag_summary(gemm_dag(traced))
            ops = self.dag.get("ops", {})
            log.info(
                "traced step: %d GEMMs (%s), %.2f GFLOP, critical path %d GEMMs",
                self.dag["gemms"],
                ", ".join(f"{n} {op}" for op, n in ops.items()),
                self.dag["gflop"],
                self.dag["critical_path"],
            )
        label = step_label(self.step)
        model = self.job.model
        named = dict(model.named_parameters())
        params = list(named.values())
        if traced is None:
            loss, stats = run_eager_step(
                self.job, self.offload, inputs, targets, self.cancel, label
            )
        else:
            leaves = pytree.tree_leaves((inputs, targets))
            flat = [p.detach() for p in params] + list(model.buffers()) + leaves
            outputs, stats = self.executor.run(traced, flat, self.cancel, label=label)
            grads, loss = outputs[:-1], outputs[-1]
            flowing = zip(traced.grad_names, grads, traced.gradients_flow(), strict=True)
            for name, g, flows in flowing:
                named[name].grad = g if flows else None
        if self.ranks is not None:
            self.ranks.average_grads(params)
        checkpoint_s = 0.0
        if self._writer is not None and self._writer.in_flight:
            waited = time.perf_counter()
            self._writer.wait()  # the snapshot in flight holds the parameters by reference
            checkpoint_s = time.perf_counter() - waited
        lr = self.job.optimizer.param_groups[0].get("lr")
        self.job.update()
        self.job.optimizer.zero_grad(set_to_none=True)
        self._heap.after_step()  # the step's tensors are gone: coordinator.step.heap says why
        if self.ranks is not None:
            self.ranks.broadcast_buffers(model)
        after = self.pool_counters()
        stats.flops.computed_here_after_all(after.flops_computed_here - before.flops_computed_here)
        first_flops = not self.flops
        self.flops = stats.flops.summary()
        if first_flops:
            log.info("FLOPs: %s", describe(self.flops))
        seconds = time.perf_counter() - started
        step, loss_value = self.step, float(loss)
        if self.ranks is not None:
            loss_value = self.ranks.mean(loss_value)  # the global batch's loss
        self.step += 1
        self._step_start = None
        self.losses.append(loss_value)
        if self.step % self.checkpoint_every == 0:
            snapped = time.perf_counter()
            with COSTS.timed("checkpoint"):
                self._start_checkpoint()
            checkpoint_s += time.perf_counter() - snapped
        cpu = since(COSTS.snapshot(), cpu_before)
        process_cpu = process_cpu_seconds() - process_before
        computing = sum(cpu.get(stage, 0.0) for stage in COMPUTING_STAGES)
        record = StepRecord(
            step=step,
            loss=loss_value,
            seconds=round(seconds, 4),
            tiles=after.tiles_verified - before.tiles_verified,
            reissued=after.reissued - before.reissued,
            workers=after.workers,
            gemms_offloaded=stats.gemms_offloaded,
            gemms_local=stats.gemms_local,
            workers_flop_share=self.flops["workers_share"],
            workers_flops=stats.flops.workers,
            captured=traced is not None,
            worker_compute_s=round(after.compute_s - before.compute_s, 4),
            cpu=cpu,
            checkpoint_s=round(checkpoint_s, 4),
            process_cpu_s=round(process_cpu, 4),
            orchestration_cpu_s=round(max(0.0, process_cpu - computing), 4),
            bytes_down=after.bytes_down - before.bytes_down,
            bytes_up=after.bytes_up - before.bytes_up,
            bytes_cut=COSTS.bytes_so_far("cut") - cut_before,
            lr=None if lr is None else float(lr),
        )
        if self.metrics_out is not None:
            with self.metrics_out.open("a") as fh:
                fh.write(json.dumps(asdict(record)) + "\n")
        return record
