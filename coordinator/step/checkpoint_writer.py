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

import logging
import threading
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
) -> Checkpoint:
    """The model's and optimizer's state as of now, valid until the next optimizer step:
    parameters and optimizer state by reference, buffers copied."""
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    state = {
        name: value.clone() if name in buffers else value
        for name, value in model.state_dict().items()
    }
    return Checkpoint(step, batches_consumed, state, optimizer.state_dict(), rng_state.clone())


class CheckpointWriter:
    """Writes snapshots to ``path`` on a thread of its own, one at a time.

    ``submit`` starts a write once the previous one has finished; ``wait`` returns once
    no write is in flight and raises what a failed write raised, so a full disk stops
    training on the training thread, as a write there would.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Condition()
        self._pending: Checkpoint | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._written: int | None = None
        self._thread: threading.Thread | None = None

    @property
    def written_step(self) -> int | None:
        """The step of the last complete checkpoint this writer wrote."""
        with self._lock:
            return self._written

    @property
    def in_flight(self) -> bool:
        with self._lock:
            return self._busy

    def submit(self, snapshot: Checkpoint) -> None:
        self.wait()
        with self._lock:
            self._pending, self._busy = snapshot, True
            if self._thread is None:
                # Not a daemon: an interpreter that exits normally finishes the write.
                self._thread = threading.Thread(
                    target=self._run, name="cleave-checkpoint", daemon=False
                )
                self._thread.start()
            self._lock.notify_all()

    def wait(self) -> None:
        with self._lock:
            while self._busy:
                self._lock.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Finish the write in flight and end the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._lock.notify_all()
        if thread is not None:
            thread.join()
        self.wait()

    def _run(self) -> None:
        COSTS.this_thread_is("checkpoint")
        me = threading.current_thread()
        while True:
            with self._lock:
                while self._pending is None and self._thread is me:
                    self._lock.wait()
                snapshot, self._pending = self._pending, None
                if snapshot is None:
                    return
            try:
                with COSTS.timed("checkpoint"):
                    write_checkpoint(self.path, snapshot)
            except BaseException as exc:  # handed to the training thread at its next wait
                log.error("checkpoint of step %d failed: %s", snapshot.step, exc)
                with self._lock:
                    self._error, self._busy = exc, False
                    self._lock.notify_all()
                continue
            with self._lock:
                self._written, self._busy = snapshot.step, False
                self._lock.notify_all()
