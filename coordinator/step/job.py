"""What a user hands to Cleave: a model, a loss, an optimizer and batches.

One training step is ``loss = loss_fn(model(inputs), targets)`` (``model(**inputs)`` for
a dict of the forward's keyword arguments, as Hugging Face models take a batch),
backward, then the update (``Job.update``): gradients clipped if the job asks,
``optimizer.step()``, and the learning-rate schedule's step. ``train_locally`` runs
exactly that with plain torch: it is the reference that distributed runs are compared
against, and a way for users to check a job before they serve it.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Batch = tuple[Any, Any]


class JobError(Exception):
    """A mistake in the job that no way of running its step gets past: reported as it
    is, not as a step that cannot be captured and is run eagerly instead."""


class LossNotATensor(JobError, TypeError):
    pass


class LossNotOneNumber(JobError, ValueError):
    pass


class BatchNotAPair(JobError, ValueError):
    pass


LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class Job:
    model: torch.nn.Module
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer
    batches: Iterable[Batch]
    name: str = "job"
    # Mixed precision: the forward and the loss run under torch.autocast("cpu", autocast),
    # as a training script would write it; its GEMMs (and their tiles) are then bf16/fp16.
    autocast: torch.dtype | None = None
    # What volunteers are shown about the job (common.job_about.JobAbout checks them;
    # cleave-coordinator's --job-* options override them).
    description: str = ""
    operator: str = ""
    link: str = ""
    # Stepped once after every optimizer step, as a training loop that schedules per
    # step does: its periods (warm-up, step_size, T_max) count steps, not epochs.
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    # Before every optimizer step the gradients are scaled to at most this total 2-norm
    # (torch.nn.utils.clip_grad_norm_ over the model's parameters).
    clip_grad_norm: float | None = None
    _iterator: Iterator[Batch] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError(f"Job.model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError("Job.optimizer must be a torch.optim.Optimizer")
        if self.autocast not in (None, torch.bfloat16, torch.float16):
            raise ValueError("Job.autocast must be None, torch.bfloat16 or torch.float16")
        if not callable(self.loss_fn):
            raise TypeError("Job.loss_fn must be callable as loss_fn(outputs, targets)")
        params = {id(p) for p in self.model.parameters()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in params:
                    raise ValueError(
                        "Job.optimizer holds a tensor that is not a parameter of Job.model"
                    )
        self._check_update()

    def _check_update(self) -> None:
        closure = inspect.signature(self.optimizer.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise ValueError(
                f"Job.optimizer ({type(self.optimizer).__name__}) needs a closure in its "
                "step, to compute the loss again: a step computes the loss and its "
                "gradients once. Use a first-order optimizer (SGD, AdamW, ...)"
            )
        scheduler, clip = self.lr_scheduler, self.clip_grad_norm
        if scheduler is not None:
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise ValueError(
                    "Job.lr_scheduler cannot be ReduceLROnPlateau: it steps on a metric, "
                    "and a job's schedule steps once per training step without one. Use "
                    "a schedule of the step count (LambdaLR, CosineAnnealingLR, ...)"
                )
            if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
                raise TypeError(
                    "Job.lr_scheduler must be a torch.optim.lr_scheduler.LRScheduler, "
                    f"not {type(scheduler).__name__}"
                )
            if scheduler.optimizer is not self.optimizer:
                raise ValueError(
                    "Job.lr_scheduler schedules another optimizer than Job.optimizer: "
                    "build it on the job's optimizer"
                )
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip < math.inf
        ):
            raise ValueError(f"Job.clip_grad_norm must be a positive number or None, not {clip!r}")

    def loss_of(self, outputs: Any, targets: Any) -> torch.Tensor:
        """``loss_fn(outputs, targets)``, refused with what to change unless it is one
        number: backward needs a scalar, and torch's own words for that do not say
        which of the job's parts gave it something else."""
        loss = self.loss_fn(outputs, targets)
        if not isinstance(loss, torch.Tensor):
            # A trace sees .item()'s number as a SymFloat: name what the author wrote.
            numeric = (bool, int, float, torch.SymBool, torch.SymInt, torch.SymFloat)
            what = (
                "a Python number (.item() or float() made one)"
                if isinstance(loss, numeric)
                else type(loss).__name__
            )
            raise LossNotATensor(
                f"Job.loss_fn must return a tensor, not {what}: return the "
                "loss itself (for example F.cross_entropy(outputs, targets))"
            )
        if loss.numel() != 1:
            raise LossNotOneNumber(
                f"Job.loss_fn must return one number, not a tensor of shape "
                f"{list(loss.shape)}: reduce it over the batch (.mean() or .sum())"
            )
        return loss

    def model_arguments(self, inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """How the model is called on a batch's ``inputs``, as (args, kwargs): a dict
        whose keys the model's forward takes goes in as keyword arguments, as Hugging
        Face models take a batch (``model(**batch)``); anything else, a dict for a
        forward that takes one included, as the one argument."""
        if isinstance(inputs, Mapping) and _takes_keywords(self.model, inputs):
            return (), dict(inputs)
        return (inputs,), {}

    def forward(self, inputs: Any) -> Any:
        """The model on a batch's ``inputs`` (``model_arguments`` says how)."""
        args, kwargs = self.model_arguments(inputs)
        return self.model(*args, **kwargs)

    def update(self) -> None:
        """The step's update once its gradients are in ``.grad``: clip them if the job
        asks, step the optimizer, then the schedule, in the order a training loop does."""
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def autocast_context(self) -> contextlib.AbstractContextManager[Any]:
        """The context the forward and the loss run in: autocast, or nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.autocast)

    def next_batch(self) -> Batch:
        """The next (inputs, targets), every mapping in it a dict (``plain_batch``);
        raises StopIteration when the data runs out."""
        if self._iterator is None:
            self._iterator = iter(self.batches)
        batch = next(self._iterator)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            what = (
                f"a mapping with keys {list(batch)[:6]}"
                if isinstance(batch, Mapping)
                else f"a {type(batch).__name__}"
                + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            )
            raise BatchNotAPair(
                f"Job.batches must yield (inputs, targets) pairs, not {what}: yield "
                "(batch, None) for a model that takes the whole batch (loss_fn gets None), "
                "or (inputs, labels)"
            )
        return plain_batch(tuple(batch))  # type: ignore[no-any-return]


def plain_batch(batch: Any) -> Any:
    """``batch`` with every mapping in it a dict: a tokenizer's ``BatchEncoding`` or a
    ``UserDict`` is a mapping but not a dict, and torch's pytree, with which a step is
    traced and a batch cut between coordinator ranks, sees into dicts, lists and tuples
    only. The model gets the same keys and values."""
    if isinstance(batch, Mapping):
        return {key: plain_batch(value) for key, value in batch.items()}
    if isinstance(batch, list):
        return [plain_batch(value) for value in batch]
    if isinstance(batch, tuple):
        values = [plain_batch(value) for value in batch]
        return type(batch)(*values) if hasattr(batch, "_fields") else tuple(values)
    return batch


def _takes_keywords(model: torch.nn.Module, inputs: Mapping[Any, Any]) -> bool:
    """Whether ``model``'s forward takes every key of ``inputs`` as a keyword argument."""
    if not all(isinstance(key, str) for key in inputs):
        return False
    try:
        inspect.signature(model.forward).bind(**dict.fromkeys(inputs))
    except (TypeError, ValueError):
        return False
    return True


def train_locally(job: Job, steps: int) -> list[float]:
    """Plain torch training of ``job`` for ``steps`` steps: the reference losses."""
    losses: list[float] = []
    job.model.train()
    for _ in range(steps):
        inputs, targets = job.next_batch()
        job.optimizer.zero_grad(set_to_none=True)
        with job.autocast_context():
            loss = job.loss_of(job.forward(inputs), targets)
        loss.backward()
        job.update()
        losses.append(float(loss.detach()))
    return losses
