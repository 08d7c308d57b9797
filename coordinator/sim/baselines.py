"""Baselines from their published cost structure, not simulated event by event.

Megatron-style tensor parallelism (Shoeybi et al. 2019): each transformer layer does two
all-reduces of the [batch x seq, hidden] activations forward and two backward; a ring
all-reduce moves 2(N-1)/N of the buffer through every device. Weights stay put.

Pipeline parallelism that restarts from a checkpoint on failure: the job stops, is
rescheduled and reloads (restart latency), then recomputes the steps since the last
checkpoint (half the interval on average).
"""

from __future__ import annotations

from coordinator.sim.models import ModelShape


def ring_allreduce_bytes(buffer_bytes: int, n: int) -> float:
    """Bytes each device sends (and receives) in one ring all-reduce."""
    return 2 * (n - 1) / n * buffer_bytes if n > 1 else 0.0


def tensor_parallel_step_bytes(
    model: ModelShape, batch: int, seq: int, n: int, itemsize: int = 4
) -> float:
    """Per-device bytes sent per training step (each way)."""
    activations = batch * seq * model.hidden * itemsize
    return model.layers * 4 * ring_allreduce_bytes(activations, n)


def restart_recovery_s(step_s: float, *, restart_s: float, checkpoint_every: int) -> float:
    """Expected time lost to one failure: restart, then redo half a checkpoint interval."""
    return restart_s + checkpoint_every / 2 * step_s
