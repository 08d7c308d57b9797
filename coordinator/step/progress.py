"""The training run's progress as ``/api/status`` shows it: state, step, recent history.

Written by the training thread (one ``add`` per step) and read by the event loop (every
status request), hence the lock. The history is capped so that a status poll stays
small however long the run.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from coordinator.step.trainer import StepRecord

HISTORY_POINTS = 500  # steps kept: enough for the dashboard's chart, small to poll
LOSSES_POINTS = 50  # the older flat "losses" list, kept for existing readers


class Progress:
    def __init__(self, steps: int, history_points: int = HISTORY_POINTS) -> None:
        self.state = "starting"
        self.step = 0  # steps completed, counting resumed ones: the next step's number
        self.steps = steps
        self.step_gflop: float | None = None  # GEMM work in one step, once traced
        self.checkpoint_step: int | None = None
        # The last step's FLOPs by who computed them (coordinator.step.flops.FlopTally.summary).
        self.flops: dict[str, Any] | None = None
        self._history: deque[dict[str, Any]] = deque(maxlen=history_points)
        self._lock = threading.Lock()

    def add(
        self,
        record: StepRecord,
        step_gflop: float | None,
        checkpoint_step: int | None,
        flops: dict[str, Any] | None = None,
    ) -> None:
        entry = {
            "step": record.step,
            "loss": record.loss,
            "seconds": record.seconds,
            "tiles": record.tiles,
            "reissued": record.reissued,
            "workers": record.workers,
            "workers_flop_share": record.workers_flop_share,
        }
        with self._lock:
            self._history.append(entry)
            self.step = record.step + 1
            self.step_gflop = step_gflop
            self.checkpoint_step = checkpoint_step
            if flops:
                self.flops = flops

    def status(self) -> dict[str, Any]:
        with self._lock:
            history = list(self._history)
            return {
                "state": self.state,
                "step": self.step,
                "steps": self.steps,
                "step_gflop": self.step_gflop,
                "checkpoint_step": self.checkpoint_step,
                "flops": self.flops,
                "history": history,
                "losses": [entry["loss"] for entry in history[-LOSSES_POINTS:]],
            }
