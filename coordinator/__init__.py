"""The Cleave coordinator: a parameter server that trains a model with volunteers' GEMMs.

The packages follow the data flow, and each imports only the ones below it (the
import-linter contracts in pyproject.toml, run by ``make lint`` and tests/unit/test_layers.py):

    cli, sim       composition roots: the ``cleave-coordinator`` command; the simulator
    serve/         I/O: the WebSocket server (a pump around the core), HTTP, metrics,
                   the offload that turns the training thread's GEMMs into tiles, Pool
    pool/          the coordinator's decisions without I/O (CoordinatorCore and its
                   effects), the workers' state, reputation, the ledger
    tiles/         a GEMM cut into signed tile bundles and put back together; the check
    schedule/      who gets which tile (pure, time injected)
    plan/          GEMM shapes, grids, the cost model and placement (pure)
    step/          a training step: capture (trace or eager), lowerings, the GEMM DAG
                   executor, FLOP accounting, the trainer and checkpoints

``Job`` and ``train_locally`` are here for job files; ``Pool`` (the coordinator inside a
training loop of one's own) is imported on first use, so a job file pulls in no server.
"""

from typing import Any

from coordinator.step.job import Job, train_locally

__all__ = ["Job", "Pool", "train_locally"]


def __getattr__(name: str) -> Any:
    if name == "Pool":
        from coordinator.serve.in_process import Pool

        return Pool
    raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
