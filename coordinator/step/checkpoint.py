"""Checkpoints of a training run: model, optimizer, learning-rate schedule, step, data
position and RNG.

A checkpoint replaces the previous one atomically (``common.atomic_file``): a crash at
any moment leaves either the previous checkpoint or the new one, never a torn file. Each
write reuses the disk space of the checkpoint before the previous one (a spare file
beside it), so the state directory holds two checkpoints' worth of disk.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.atomic_file import write_recycling


@dataclass(frozen=True)
class Checkpoint:
    step: int  # steps completed: training resumes at this step number
    batches_consumed: int  # job.next_batch() calls so far: the data position
    model: dict[str, Any]
    optimizer: dict[str, Any]
    rng_state: torch.Tensor  # torch's global CPU RNG, so dropout streams continue
    scheduler: dict[str, Any] | None = None  # the job's lr_scheduler, if it has one


def save_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    batches_consumed: int,
    rng_state: torch.Tensor,
) -> None:
    write_checkpoint(
        path,
        Checkpoint(step, batches_consumed, model.state_dict(), optimizer.state_dict(), rng_state),
    )


def write_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    payload = {
        "version": 1,
        "step": ckpt.step,
        "batches_consumed": ckpt.batches_consumed,
        "model": ckpt.model,
        "optimizer": ckpt.optimizer,
        "rng_state": ckpt.rng_state,
        "scheduler": ckpt.scheduler,
    }
    with _without_crc32():
        write_recycling(path, lambda fh: torch.save(payload, fh))


def _without_crc32() -> contextlib.AbstractContextManager[object]:
    """torch.save without the zip records' CRC32, which cost most of a large
    checkpoint's CPU (miniz's checksum runs far below memory speed). Nothing is lost by
    it: ``write_recycling`` already makes a torn file impossible, and torch.load does not
    verify the checksums. Older torch without the option writes them."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return contextlib.nullcontext()
    return config.patch({"save.compute_crc32": False})  # type: ignore[attr-defined,no-any-return]


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
        scheduler=data.get("scheduler"),  # absent from checkpoints of older versions
    )
