"""Dataflow interpreter of a traced step: GEMMs go out as tiles, everything else runs here.

A node runs as soon as its inputs exist, so independent GEMMs are in flight together
while the coordinator computes the cheap non-GEMM ops around them. Ready nodes run in
graph order, which keeps local results (and RNG use) the same from run to run. Values
are freed as soon as their last user has run, as eager autograd would.
"""

from __future__ import annotations

import heapq
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from common.ops import TileOp
from common.unfold import Unfold
from coordinator.step.cpu_costs import COSTS
from coordinator.step.flops import FlopTally, op_name
from coordinator.step.gemm_start import start_gemm
from coordinator.step.grouped_mm import GROUPED_MM, GroupedCall, split_grouped_mm, start_pieces
from coordinator.step.tracing import GEMM_OPS, TracedStep, gemm_operands

# torch.fx names the nodes that stand for the graph's inputs by this op; the executor
# feeds them the step's flattened arguments and keeps their values for the whole step.
FX_GRAPH_INPUT = "placeholder"

GemmDone = Callable[[torch.Tensor | BaseException], None]


class GemmOffload(Protocol):
    def start(
        self,
        name: str,
        op: str,
        a: torch.Tensor,
        b: torch.Tensor,
        done: GemmDone,
        unfold: Unfold | None = None,
    ) -> int:
        """Begin computing ``a @ b`` elsewhere ("mm": 2-D, "bmm": 3-D; with ``unfold``,
        one of them is an image block standing for its patch matrix) and call ``done``
        (from any thread) with the product, a tensor nothing else holds (an addmm's
        bias is added into it), or an exception. Returns the FLOPs handed to
        workers (some tiles may be computed here); 0: nothing started, run it locally."""
        ...


class StepCancelled(Exception):
    """The step was abandoned (shutdown) before it finished."""


@dataclass(frozen=True)
class _Piece:
    """One group's product of a grouped GEMM node, as it comes back."""

    index: int
    value: torch.Tensor | BaseException


@dataclass
class StepStats:
    gemms_offloaded: int = 0
    gemms_local: int = 0
    max_gemms_in_flight: int = 0
    flops: FlopTally = field(default_factory=FlopTally)


def _is_mutating(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _is_random(node: Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in tags


def _dependencies(nodes: Sequence[Node]) -> dict[Node, set[Node]]:
    """Data dependencies, plus two orderings that data alone does not give:

    - a node that mutates an input in place waits for everything before it, and
      everything after waits for it;
    - random ops (dropout, bernoulli, randn) run in graph order, one after another, so
      they draw from the RNG in the same order as eager torch, however late the GEMMs
      they depend on come back.
    """
    deps: dict[Node, set[Node]] = {}
    last_mutation: Node | None = None
    last_random: Node | None = None
    for i, node in enumerate(nodes):
        d = set(node.all_input_nodes)
        if _is_mutating(node):
            d |= set(nodes[:i])
            last_mutation = node
        elif last_mutation is not None:
            d.add(last_mutation)
        if _is_random(node):
            if last_random is not None:
                d.add(last_random)
            last_random = node
        deps[node] = d
    return deps


class DataflowExecutor:
    def __init__(self, offload: GemmOffload | None = None, *, poll_s: float = 0.1) -> None:
        self._offload = offload
        self._poll_s = poll_s

    def run(
        self,
        traced: TracedStep,
        flat_args: Sequence[Any],
        cancel: threading.Event | None = None,
        label: str = "",
    ) -> tuple[list[Any], StepStats]:
        """Run one step. ``label`` prefixes the names the offload sees ("s3:mm_12"), so
        every GEMM of a run has its own name."""
        flow = _Dataflow(list(traced.graph.nodes))
        node_flops, labels = traced.flops(), traced.labels()
        graph_inputs = iter(flat_args)  # fed to the graph's input nodes, in order
        env = flow.env
        completions: queue.SimpleQueue[tuple[Node, Any]] = queue.SimpleQueue()
        grouped: dict[Node, GroupedCall] = {}  # grouped GEMMs whose groups are out
        in_flight = 0
        stats = StepStats()
        result: list[Any] | None = None
        while not flow.done():
            if cancel is not None and cancel.is_set():
                raise StepCancelled("step cancelled")
            while (node := flow.next_ready()) is not None:
                if node.op == FX_GRAPH_INPUT:
                    flow.complete(node, next(graph_inputs))
                elif node.op == "get_attr":
                    flow.complete(node, getattr(traced.graph_module, str(node.target)))
                elif node.op == "output":
                    result = list(map_arg(node.args[0], lambda n: env[n]))  # type: ignore[arg-type]
                    flow.complete(node, None)
                elif node.target in GEMM_OPS and (
                    sent := self._start_gemm(node, env, completions, label)
                ):
                    in_flight += 1
                    stats.gemms_offloaded += 1
                    stats.max_gemms_in_flight = max(stats.max_gemms_in_flight, in_flight)
                    stats.flops.workers += sent
                    stats.flops.keep(op_name(node.target), node_flops[node] - sent)
                elif node.target is GROUPED_MM and (
                    call := self._start_grouped(node, env, completions, label, stats)
                ):
                    grouped[node] = call
                    in_flight += 1
                    stats.max_gemms_in_flight = max(stats.max_gemms_in_flight, in_flight)
                else:
                    stats.flops.ran_here(node.target, node_flops[node], labels.get(node))
                    args = map_arg(node.args, lambda n: env[n])
                    kwargs = map_arg(node.kwargs, lambda n: env[n])
                    if node.target in GEMM_OPS:
                        stats.gemms_local += 1
                        with COSTS.timed("kept_gemms"):
                            value = node.target(*args, **kwargs)  # type: ignore[operator]
                    else:
                        value = node.target(*args, **kwargs)  # type: ignore[operator]
                    flow.complete(node, value)
                    flow.release(node)
            if flow.done():
                break
            if in_flight == 0:
                raise RuntimeError("dataflow executor stalled: no node ready and no GEMM in flight")
            try:
                node, value = completions.get(timeout=self._poll_s)
            except queue.Empty:
                continue
            if isinstance(value, _Piece):
                if isinstance(value.value, BaseException):
                    raise value.value
                call = grouped[node]
                call.put(value.index, value.value)
                if call.left:
                    continue
                value = grouped.pop(node).out
            in_flight -= 1
            if isinstance(value, BaseException):
                raise value
            flow.complete(node, _finish_gemm(node, env, value))
            flow.release(node)
        assert result is not None
        return result, stats

    def _start_grouped(
        self,
        node: Node,
        env: dict[Node, Any],
        completions: queue.SimpleQueue[tuple[Node, Any]],
        label: str,
        stats: StepStats,
    ) -> GroupedCall | None:
        """Split a grouped GEMM by its offsets, now that they are known, and send its groups
        out; None: it runs here as it is."""
        args = map_arg(node.args, lambda n: env[n])
        kwargs = map_arg(node.kwargs, lambda n: env[n])
        call = split_grouped_mm(*args, **kwargs)  # type: ignore[arg-type]
        if call is None or not call.pieces:
            return None

        def done(index: int, value: torch.Tensor | BaseException) -> None:
            completions.put((node, _Piece(index, value)))

        name = f"{label}:{node.name}" if label else node.name
        sent = start_pieces(call, self._offload, name, done)
        if sent:
            stats.gemms_offloaded += 1
        else:
            stats.gemms_local += 1
        stats.flops.workers += sent
        stats.flops.keep(op_name(node.target), call.flops - sent)
        return call

    def _start_gemm(
        self,
        node: Node,
        env: dict[Node, Any],
        completions: queue.SimpleQueue[tuple[Node, Any]],
        label: str,
    ) -> int:
        if self._offload is None:
            return 0
        op = GEMM_OPS[node.target]  # type: ignore[index]
        a_node, b_node, unfold = gemm_operands(node.target, node.args)
        a, b = env[a_node], env[b_node]

        def done(value: torch.Tensor | BaseException) -> None:
            completions.put((node, value))

        name = f"{label}:{node.name}" if label else node.name
        if unfold is None:  # keeps offloads that know no unfolded operands working
            return start_gemm(
                self._offload, name, TileOp.BMM if op == "bmm" else TileOp.MM, a, b, done
            )
        return self._offload.start(name, TileOp.MM, a, b, done, unfold)


class _Dataflow:
    """Which nodes of one step can run, and which values are still needed: a node is
    ready when its inputs exist; ready nodes come out in graph order; a value goes as
    soon as its last user has run (the graph's inputs stay for the whole step)."""

    def __init__(self, nodes: list[Node]) -> None:
        self._count = len(nodes)
        self._order = {node: i for i, node in enumerate(nodes)}
        deps = _dependencies(nodes)
        self._waiting = {node: len(d) for node, d in deps.items()}
        self._dependents: dict[Node, list[Node]] = {node: [] for node in nodes}
        for node, d in deps.items():
            for dep in d:
                self._dependents[dep].append(node)
        self._uses_left = {node: len(node.users) for node in nodes}
        self._ready = [(self._order[n], n) for n in nodes if self._waiting[n] == 0]
        heapq.heapify(self._ready)
        self._finished = 0
        self.env: dict[Node, Any] = {}

    def done(self) -> bool:
        return self._finished == self._count

    def next_ready(self) -> Node | None:
        return heapq.heappop(self._ready)[1] if self._ready else None

    def complete(self, node: Node, value: Any) -> None:
        self.env[node] = value
        self._finished += 1
        for user in self._dependents[node]:
            self._waiting[user] -= 1
            if self._waiting[user] == 0:
                heapq.heappush(self._ready, (self._order[user], user))

    def release(self, node: Node) -> None:
        for inp in node.all_input_nodes:
            self._uses_left[inp] -= 1
            if self._uses_left[inp] == 0 and inp.op != FX_GRAPH_INPUT:
                self.env.pop(inp, None)


def _finish_gemm(node: Node, env: dict[Node, Any], product: torch.Tensor) -> torch.Tensor:
    if GEMM_OPS.get(node.target) != "addmm":  # type: ignore[call-overload]
        return product
    return finish_addmm(product, env[node.args[0]], node.kwargs)  # type: ignore[index]


def finish_addmm(product: torch.Tensor, bias: torch.Tensor, kwargs: Any) -> torch.Tensor:
    """addmm is ``beta * bias + alpha * (a @ b)``; the tiles computed only ``a @ b``.
    ``product`` is the GEMM's own output, which nothing else holds: the rest is added
    into it, not into a new tensor of its size (fresh pages to fault in, every layer)."""
    beta: Any = kwargs.get("beta", 1)
    alpha: Any = kwargs.get("alpha", 1)
    if alpha != 1:
        product.mul_(alpha)
    return product.add_(bias if beta == 1 else bias * beta)
