"""Several coordinator ranks training one model: data parallel over ``torch.distributed``.

Each rank is a whole coordinator (trace, plan, its own endpoint and workers) and trains on
its slice of every global batch: the job's batches are drawn on every rank alike and
each rank keeps rows ``[r·B/R, (r+1)·B/R)``. Before the optimizer step the ranks average
their gradients (one gloo all-reduce over all of them, flattened into one bucket), so
every rank steps its own replica of the model identically. The step's loss is the mean
of the ranks' losses. Both equal local training on the global batch when the job's loss
is a mean over the batch's rows (as ``F.cross_entropy``'s default is) and the model has
no batch statistics. BatchNorm normalises each rank's slice with that slice's statistics
and every rank keeps rank 0's running statistics, as ``DistributedDataParallel`` does;
dropout draws each rank's masks from the same seed. A restart goes on from the newest
checkpoint any rank holds.

Ranks find each other through torch.distributed's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) as ``torchrun`` sets it, or through a file when
``serve --ranks`` starts them on one host. The store and the gloo links carry no
authentication: ``serve --ranks`` opens no port for them (a file store, gloo on the
loopback interface); under torchrun, the TCP store listens on every interface of the
master's host and gloo on ``GLOO_SOCKET_IFNAME``'s (the host name's address if unset),
which the operator keeps out of the workers' reach.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.rendezvous import rendezvous

from coordinator.step.checkpoint import Checkpoint

log = logging.getLogger("cleave.coordinator")

# Ranks wait this long for each other at start-up and at each all-reduce: long enough
# for a rank still tracing its first step on a loaded machine.
TIMEOUT = datetime.timedelta(minutes=10)


class BatchSplitError(ValueError):
    """A global batch that does not split evenly across the ranks."""


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    # The store the ranks met through, shared for small keys beside the process group
    # (each rank's status summary); None where no group was made (tests).
    store: dist.Store | None = None

    def slice(self, batch: Any) -> Any:
        """This rank's rows of every tensor in ``batch`` (inputs and targets alike)."""
        leaves, spec = pytree.tree_flatten(batch)
        out = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                rows = leaf.shape[0]
                if rows % self.world:
                    raise BatchSplitError(
                        f"a batch of {rows} rows (a tensor of shape {tuple(leaf.shape)}) does "
                        f"not split evenly across {self.world} coordinator ranks: make the "
                        f"job's batch size a multiple of {self.world}"
                    )
                share = rows // self.world
                leaf = leaf[self.rank * share : (self.rank + 1) * share]
            out.append(leaf)
        return pytree.tree_unflatten(out, spec)

    def average_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Replace each parameter's gradient by its mean over the ranks."""
        grads = [p.grad for p in params if p.grad is not None]
        for bucket in _buckets(grads):
            dist.all_reduce(bucket.flat)
            bucket.flat.div_(self.world)
            bucket.scatter()

    def broadcast_buffers(self, module: torch.nn.Module) -> None:
        """Every rank takes rank 0's buffers (BatchNorm's running statistics and its
        batch counter), as ``DistributedDataParallel`` does before each forward: the
        replicas, and so their checkpoints, stay equal."""
        for bucket in _buckets(list(module.buffers())):
            dist.broadcast(bucket.flat, src=0)
            bucket.scatter()

    def newest_checkpoint(self, mine: Checkpoint | None) -> Checkpoint | None:
        """The newest checkpoint any rank holds, the same on every rank.

        A rank killed while its write was in flight, or a rank whose state directory
        was lost, holds an older checkpoint than the others (or none). The replicas are
        equal at every step boundary and every rank draws the whole global batch, so
        any rank's checkpoint of step k is every rank's: the newest is sent to the
        others, and all ranks go on from it together."""
        steps: list[Any] = [None] * self.world
        dist.all_gather_object(steps, -1 if mine is None else mine.step)
        newest = max(steps)
        if newest < 0 or all(step == newest for step in steps):
            return mine
        source = steps.index(newest)
        box = [mine if self.rank == source else None]
        dist.broadcast_object_list(box, src=source)
        if self.rank != source:
            log.info(
                "rank %d: resuming from rank %d's checkpoint of step %d (this rank's: %s)",
                self.rank,
                source,
                newest,
                "none" if mine is None else f"step {mine.step}",
            )
        return box[0]  # type: ignore[no-any-return]

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the ranks (the step's loss)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / self.world

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class _Bucket:
    """Tensors of one dtype flattened into one, for one collective call."""

    flat: torch.Tensor
    parts: list[torch.Tensor]

    def scatter(self) -> None:
        """Copy the flat tensor's values back into the tensors it was made of."""
        offset = 0
        for part in self.parts:
            part.copy_(self.flat[offset : offset + part.numel()].view_as(part))
            offset += part.numel()


def _buckets(tensors: Sequence[torch.Tensor]) -> list[_Bucket]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    return [
        _Bucket(torch.cat([t.reshape(-1) for t in group]), group) for group in by_dtype.values()
    ]


# Set by ``serve --ranks``: the file through which its ranks on this host meet.
RENDEZVOUS_FILE = "CLEAVE_RENDEZVOUS_FILE"


def rank_environment(rank: int, world: int, meeting: Path) -> dict[str, str]:
    """The environment of rank ``rank`` of ``world`` on this host, meeting through the
    file ``meeting``, its gloo links on the loopback interface."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        RENDEZVOUS_FILE: str(meeting),
    }
    loopback = _loopback_interface()
    if loopback is not None:
        env["GLOO_SOCKET_IFNAME"] = loopback
    return env


def _loopback_interface() -> str | None:
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return name
    return None


def from_environment() -> Ranks | None:
    """The ranks this process is one of, joined, or None when it runs alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    rank = int(os.environ["RANK"])
    store = _store(rank, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    return Ranks(rank, world, store)


def _store(rank: int, world: int) -> dist.Store:
    meeting = os.environ.get(RENDEZVOUS_FILE)
    if meeting:
        return dist.FileStore(meeting, world)
    # torchrun's (MASTER_ADDR, MASTER_PORT): a TCPStore, which listens on every
    # interface of the master's host.
    store, _, _ = next(rendezvous("env://", rank, world, timeout=TIMEOUT))
    # torchrun's static rendezvous keeps one store across its restarts, so a restarted
    # group could read the dead ranks' gloo addresses from it: each attempt gets keys of
    # its own.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"cleave/attempt-{attempt}", store)
