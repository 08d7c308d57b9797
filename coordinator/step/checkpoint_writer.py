"""Checkpoints written off the training thread: one write in flight, joined before the
next optimizer step.

A snapshot taken at a step boundary holds the parameters and the optimizer's state by
reference, not by copy: nothing changes them until the next ``optimizer.step()``, and the
trainer waits for the write in flight before it takes that step. Buffers are copied,
since a forward may update them in place (BatchNorm's running statistics) while the
write is still reading. So the next step's GEMMs run while the checkpoint is written,
the training thread pays only for taking the snapshot, and memory grows by no second
copy of the model.

A crash during a write leaves the previous complete checkpoint (``atomic_write``): what
is lost is at most the steps after it plus the step in flight.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from coordinator.step.checkpoint import Checkpoint, write_checkpoint
from coordinator.step.cpu_costs import COSTS

log = logging.getLogger("cleave.coordinator")


def take_snapshot(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    batches_consumed: int,
    rng_state: torch.Tensor,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> Checkpoint:
    """The model's, optimizer's and schedule's state as of now, valid until the next
    optimizer step: parameters and optimizer state by reference, buffers and the
    schedule's few numbers copied."""
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    state = {
        name: value.clone() if name in buffers else value
        for name, value in model.state_dict().items()
    }
    scheduler = None if lr_scheduler is None else copy.deepcopy(lr_scheduler.state_dict())
    return Checkpoint(
        step, batches_consumed, state, optimizer.state_dict(), rng_state.clone(), scheduler
    )


class CheckpointWriter:
    """Writes snapshots to ``path`` off the training thread, one at a time.

    Each write runs on a thread of its own that ends with it, so no idle thread outlives
    the trainer: a process whose trainer was never closed still exits. The thread is not
    a daemon: an interpreter that exits normally finishes the write in flight first.

    ``submit`` starts a write once the previous one has finished; ``wait`` returns once
    no write is in flight and raises what a failed write raised, so a full disk stops
    training on the training thread, as a write there would.
    """

    def __init__(self, path: Path, on_written: Callable[[int], None] = lambda step: None) -> None:
        """``on_written(step)`` is called on the writer's thread once a snapshot of
        ``step`` is complete on disk."""
        self.path = path
        self._on_written = on_written
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._written: int | None = None

    @property
    def written_step(self) -> int | None:
        """The step of the last complete checkpoint this writer wrote."""
        with self._lock:
            return self._written

    @property
    def in_flight(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def submit(self, snapshot: Checkpoint) -> None:
        self.wait()
        self._thread = threading.Thread(
            target=self._write, args=(snapshot,), name="cleave-checkpoint", daemon=False
        )
        self._thread.start()

    def wait(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    close = wait

    def _write(self, snapshot: Checkpoint) -> None:
        try:
            # A stage of its own, not a thread role: each write's thread ends with it,
            # and an ended thread's clock can no longer be read.
            with COSTS.timed("checkpoint_write"):
                write_checkpoint(self.path, snapshot)
        except BaseException as exc:  # handed to the training thread at its next wait
            log.error("checkpoint of step %d failed: %s", snapshot.step, exc)
            with self._lock:
                self._error = exc
            return
        with self._lock:
            self._written = snapshot.step
        try:
            self._on_written(snapshot.step)
        except Exception:  # the checkpoint stands; only what follows it failed
            log.exception("after the checkpoint of step %d", snapshot.step)
