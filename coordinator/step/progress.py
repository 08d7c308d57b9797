"""The training run's progress as ``/api/status`` shows it: state, step, recent history.

Written by the training thread (one ``add`` per step) and read by the event loop (every
status request), hence the lock. The history is capped so that a status poll stays
small however long the run.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from coordinator.step.run_state import RunState
from coordinator.step.trainer import StepRecord

# What workers are told when no tiles come, by the run's state; while training, the
# last step says it (``Progress.note``).
STATE_NOTES = {
    RunState.STARTING: "the coordinator is preparing the job",
    RunState.WAITING: "training starts once enough workers have joined",
    RunState.STOPPING: "the coordinator is stopping",
    RunState.STOPPED: "the coordinator has stopped training",
    RunState.DONE: "the training run has finished; there is no more work",
    RunState.FAILED: "the training run has stopped after an error",
}
ALONE_NOTE = "the coordinator needs no help with this job right now; it computes faster alone"
FEW_TILES_NOTE = "this job has fewer tiles in a step than there are workers, so some workers wait"

HISTORY_POINTS = 500  # steps kept: enough for the dashboard's chart, small to poll
LOSSES_POINTS = 50  # the older flat "losses" list, kept for existing readers


class Progress:
    def __init__(
        self,
        steps: int,
        history_points: int = HISTORY_POINTS,
        on_change: Callable[[Progress], None] | None = None,
    ) -> None:
        # Called after each step and each change of state, on the thread that made it
        # (the workers' JobState follows it).
        self._on_change = on_change
        self._state = RunState.STARTING
        self.step = 0  # steps completed, counting resumed ones: the next step's number
        self.steps = steps
        self.step_gflop: float | None = None  # GEMM work in one step, once traced
        self.checkpoint_step: int | None = None
        # The last step's FLOPs by who computed them (coordinator.step.flops.FlopTally.summary).
        self.flops: dict[str, Any] | None = None
        self._history: deque[dict[str, Any]] = deque(maxlen=history_points)
        self._lock = threading.Lock()

    @property
    def state(self) -> RunState:
        return self._state

    @state.setter
    def state(self, state: RunState | str) -> None:
        self._state = RunState(state)
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)

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
            "orchestration_cpu_s": record.orchestration_cpu_s,
        }
        with self._lock:
            self._history.append(entry)
            self.step = record.step + 1
            self.step_gflop = step_gflop
            self.checkpoint_step = checkpoint_step
            if flops:
                self.flops = flops
        self._changed()

    def note(self) -> str:
        """Why a connected worker may get no tiles now, in words for volunteers ("" when
        the last step handed work to every worker there was)."""
        with self._lock:
            return self._note()

    def _note(self) -> str:
        if self.state is not RunState.TRAINING:
            return STATE_NOTES.get(self.state, "")
        if not self._history:
            return ""
        last = self._history[-1]
        if last["workers"] and not last["tiles"]:
            # The planner found every GEMM of the step faster here than as tiles.
            return ALONE_NOTE
        if last["tiles"] < last["workers"]:
            return FEW_TILES_NOTE
        return ""

    def status(self) -> dict[str, Any]:
        with self._lock:
            history = list(self._history)
            return {
                "state": self.state.value,
                "note": self._note(),
                "step": self.step,
                "steps": self.steps,
                "step_gflop": self.step_gflop,
                "checkpoint_step": self.checkpoint_step,
                "flops": self.flops,
                "history": history,
                "losses": [entry["loss"] for entry in history[-LOSSES_POINTS:]],
            }
