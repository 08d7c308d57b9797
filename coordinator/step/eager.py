"""The fallback for steps that cannot be one graph: run them eagerly, GEMMs still go out.

Some model code decides in Python on a tensor's value (a mask helper that checks
``mask.any()``, a loss that reads ``.item()``): make_fx cannot trace through that. Such a
step runs here as plain eager torch under a dispatch mode that sits below autograd, so it
sees every aten op of the forward and the backward exactly as local training runs them:

- each GEMM (``mm``, ``bmm``, ``addmm``) is handed to the offload and waited for, so its
  tiles go to workers and are checked like any other; a grouped GEMM (``_grouped_mm``)
  goes out as its groups' products, all in flight together;
- fused attention and convolutions are lowered to GEMMs first (``coordinator.step.lowering``);
- everything else runs here.

Against a captured step this loses the overlap between independent GEMMs (one is in
flight at a time) and the coordinator's own share of a GEMM's tiles; it keeps every
Python decision the model makes, on the step's real data.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.ops import TileOp
from coordinator.step.cpu_costs import COSTS
from coordinator.step.executor import GemmOffload, StepCancelled, StepStats, finish_addmm
from coordinator.step.flops import op_flops, op_label, op_name
from coordinator.step.gemm_names import eager_name
from coordinator.step.gemm_start import start_gemm
from coordinator.step.grouped_mm import GROUPED_MM, split_grouped_mm, start_pieces
from coordinator.step.job import Job
from coordinator.step.lowering import LOWERINGS
from coordinator.step.tracing import GEMM_OPS, gemm_operands


class EagerOffloadMode(TorchDispatchMode):
    def __init__(
        self,
        offload: GemmOffload | None,
        cancel: threading.Event,
        label: str,
        poll_s: float = 0.1,
    ) -> None:
        super().__init__()
        self._offload = offload
        self._cancel = cancel
        self._label = label
        self._poll_s = poll_s
        self._count = 0
        self.stats = StepStats()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._cancel.is_set():
            raise StepCancelled("step cancelled")
        lowering = LOWERINGS.get(func)
        if lowering is not None:
            with self:  # the lowering's own GEMMs come back through this mode
                out = lowering(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if func in GEMM_OPS:
            out = self._gemm(func, args, kwargs)
            if out is not None:
                return out
            self.stats.gemms_local += 1
            with COSTS.timed("kept_gemms"):
                out = func(*args, **kwargs)
        elif func is GROUPED_MM and (out := self._grouped(func, args, kwargs)) is not None:
            return out
        else:
            out = func(*args, **kwargs)
        self.stats.flops.ran_here(func, op_flops(func, args, kwargs, out), op_label(func, args))
        return out

    def _wait(self, results: queue.SimpleQueue[Any]) -> Any:
        while True:
            if self._cancel.is_set():
                raise StepCancelled("step cancelled")
            try:
                value = results.get(timeout=self._poll_s)
            except queue.Empty:
                continue
            if isinstance(value, BaseException):
                raise value
            return value

    def _grouped(self, func: Any, args: tuple[Any, ...], kwargs: Any) -> torch.Tensor | None:
        call = split_grouped_mm(*args, **kwargs)
        if call is None or not call.pieces:
            return None
        results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        name = eager_name(self._label, "grouped_mm", self._count)
        self._count += 1
        sent = start_pieces(call, self._offload, name, lambda i, v: results.put((i, v)))
        while call.left:
            index, value = self._wait(results)
            if isinstance(value, BaseException):
                raise value
            call.put(index, value)
        if sent:
            self.stats.gemms_offloaded += 1
            self.stats.max_gemms_in_flight = 1
        else:
            self.stats.gemms_local += 1
        self.stats.flops.workers += sent
        self.stats.flops.keep(op_name(func), call.flops - sent)
        return call.out

    def _gemm(self, func: Any, args: tuple[Any, ...], kwargs: Any) -> torch.Tensor | None:
        if self._offload is None:
            return None
        op = GEMM_OPS[func]
        a, b, unfold = gemm_operands(func, args)
        results: queue.SimpleQueue[torch.Tensor | BaseException] = queue.SimpleQueue()
        name = eager_name(self._label, op, self._count)
        self._count += 1
        if unfold is None:
            sent = start_gemm(
                self._offload, name, TileOp.BMM if op == "bmm" else TileOp.MM, a, b, results.put
            )
        else:
            sent = self._offload.start(name, TileOp.MM, a, b, results.put, unfold)
        if not sent:
            return None
        self.stats.gemms_offloaded += 1
        self.stats.max_gemms_in_flight = 1
        value = self._wait(results)
        out = finish_addmm(value, args[0], kwargs) if op == "addmm" else value
        self.stats.flops.workers += sent
        self.stats.flops.keep(op_name(func), op_flops(func, args, kwargs, out) - sent)
        return out


def run_eager_step(
    job: Job,
    offload: GemmOffload | None,
    inputs: Any,
    targets: Any,
    cancel: threading.Event,
    label: str,
) -> tuple[torch.Tensor, StepStats]:
    """Forward, loss and backward as local training does them; leaves ``param.grad`` set."""
    mode = EagerOffloadMode(offload, cancel, label)
    job.model.train()
    with mode:
        with job.autocast_context():
            loss = job.loss_of(job.forward(inputs), targets)
        loss.backward()
    return loss.detach(), mode.stats
