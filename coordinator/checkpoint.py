"""Checkpoints of a training run: model, optimizer, step, data position and RNG.

A checkpoint is written to a temporary file in the same directory, fsynced, then
renamed over the old one with ``os.replace`` and the directory fsynced: a crash at any
moment leaves either the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Checkpoint:
    step: int  # steps completed: training resumes at this step number
    batches_consumed: int  # job.next_batch() calls so far: the data position
    model: dict[str, Any]
    optimizer: dict[str, Any]
    rng_state: torch.Tensor  # torch's global CPU RNG, so dropout streams continue


def save_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    batches_consumed: int,
    rng_state: torch.Tensor,
) -> None:
    payload = {
        "version": 1,
        "step": step,
        "batches_consumed": batches_consumed,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng_state": rng_state,
    }
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open a directory
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path) -> Checkpoint | None:
    """The checkpoint at ``path``, or None if there is none yet."""
    if not path.exists():
        return None
    # weights_only=False unpickles arbitrary objects (optimizer state may hold plain
    # Python values). Acceptable here: this file is written by the coordinator itself
    # into the operator's own state directory; it is never received over the network.
    data = torch.load(path, map_location="cpu", weights_only=False)
    return Checkpoint(
        step=int(data["step"]),
        batches_consumed=int(data["batches_consumed"]),
        model=data["model"],
        optimizer=data["optimizer"],
        rng_state=data["rng_state"],
    )
