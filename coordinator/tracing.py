"""Trace one training step (forward + backward) into an aten graph, and find its GEMMs.

``make_fx`` over a functional step (``functional_call`` + ``grad_and_value``) gives the
whole step as aten ops, with every GEMM as ``aten.mm``, ``aten.bmm`` or ``aten.addmm``.
The step is functionalized so that no node mutates another's output: the dataflow
executor may then run independent nodes in any order. Mutations of inputs (e.g.
BatchNorm's running statistics) remain as copies into buffers; the executor orders them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
import torch.utils._pytree as pytree
from torch.func import functional_call, functionalize, grad_and_value
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

from coordinator.job import Job

aten = torch.ops.aten
GEMM_OPS = {aten.mm.default: "mm", aten.bmm.default: "bmm", aten.addmm.default: "addmm"}


@dataclass(frozen=True)
class TracedStep:
    """One traced training step.

    Call signature of the graph (flat): ``*params, *buffers, *input_leaves`` ->
    ``[*grads, loss]`` with params/buffers in ``param_names``/``buffer_names`` order.
    """

    graph_module: GraphModule
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    batch_spec: pytree.TreeSpec

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def gemm_nodes(self) -> list[Node]:
        return [n for n in self.graph.nodes if n.op == "call_function" and n.target in GEMM_OPS]


def shape_key(batch: Any) -> tuple[Any, ...]:
    """Traces are valid per input shape and dtype: the cache key."""
    leaves, spec = pytree.tree_flatten(batch)
    return (
        str(spec),
        tuple(
            (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (type(x), x)
            for x in leaves
        ),
    )


def trace_step(job: Job, inputs: Any, targets: Any) -> TracedStep:
    model = job.model
    param_names = tuple(name for name, _ in model.named_parameters())
    buffer_names = tuple(name for name, _ in model.named_buffers())
    params = [p.detach() for _, p in model.named_parameters()]
    # Tracing in real mode runs the step once: clones keep it from updating the real
    # buffers (BatchNorm statistics would move twice on the first step).
    buffers = [b.detach().clone() for _, b in model.named_buffers()]
    leaves, batch_spec = pytree.tree_flatten((inputs, targets))
    n_params, n_buffers = len(params), len(buffers)

    def step(*flat: Any) -> list[torch.Tensor]:
        p = dict(zip(param_names, flat[:n_params], strict=True))
        b = dict(zip(buffer_names, flat[n_params : n_params + n_buffers], strict=True))
        x, y = pytree.tree_unflatten(list(flat[n_params + n_buffers :]), batch_spec)

        # Buffers go in as an argument (not captured) so that in-place updates to them
        # are allowed under grad_and_value; gradients are taken for p_ only.
        def loss_of(p_: dict[str, torch.Tensor], b_: dict[str, torch.Tensor]) -> torch.Tensor:
            return job.loss_fn(functional_call(model, (p_, b_), (x,)), y)

        grads, loss = grad_and_value(loss_of)(p, b)
        return [grads[name] for name in param_names] + [loss]

    was_training = model.training
    model.train()
    try:
        # The trace draws from the global RNG (dropout masks) like a real step would;
        # forking it leaves the RNG stream to the real steps, as in local training.
        with torch.random.fork_rng(devices=[]):
            gm = make_fx(functionalize(step, remove="mutations"))(*params, *buffers, *leaves)
    finally:
        model.train(was_training)
    return TracedStep(gm, param_names, buffer_names, batch_spec)


class StepTracer:
    """Traces once per input shape and reuses the graph for every later batch of it."""

    def __init__(self, job: Job, trace: Callable[[Job, Any, Any], TracedStep] = trace_step):
        self._job = job
        self._trace = trace
        self._cache: dict[tuple[Any, ...], TracedStep] = {}

    def get(self, inputs: Any, targets: Any) -> TracedStep:
        key = shape_key((inputs, targets))
        traced = self._cache.get(key)
        if traced is None:
            traced = self._cache[key] = self._trace(self._job, inputs, targets)
        return traced


# ---- GEMM geometry and the GEMM DAG ---------------------------------------------------


@dataclass(frozen=True)
class GemmInfo:
    name: str
    op: str  # "mm", "bmm" or "addmm"
    batch: int
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


def _meta_shape(node: Node) -> Sequence[int]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"node {node.name} has no traced tensor value")
    return tuple(val.shape)


def gemm_info(node: Node) -> GemmInfo:
    op = GEMM_OPS[node.target]  # type: ignore[index]
    a, b = (node.args[1], node.args[2]) if op == "addmm" else (node.args[0], node.args[1])
    sa, sb = _meta_shape(a), _meta_shape(b)  # type: ignore[arg-type]
    if op == "bmm":
        return GemmInfo(node.name, op, sa[0], sa[1], sb[2], sa[2])
    return GemmInfo(node.name, op, 1, sa[0], sb[1], sa[1])


def gemm_dag(traced: TracedStep) -> nx.DiGraph:
    """GEMMs as nodes, with an edge when one GEMM's output reaches another through any ops."""
    dag = nx.DiGraph()
    gemms = set(traced.gemm_nodes())
    # For every node, the set of GEMMs whose outputs flow into it (transitively).
    upstream: dict[Node, frozenset[Node]] = {}
    for node in traced.graph.nodes:
        sources: set[Node] = set()
        for inp in node.all_input_nodes:
            sources |= upstream[inp]
            if inp in gemms:
                sources.add(inp)
        upstream[node] = frozenset(sources)
        if node in gemms:
            info = gemm_info(node)
            dag.add_node(
                node.name,
                op=info.op,
                batch=info.batch,
                m=info.m,
                n=info.n,
                k=info.k,
                flops=info.flops,
            )
            # Only direct GEMM predecessors: drop sources already implied through another.
            implied = set().union(*(upstream[s] for s in sources)) if sources else set()
            for src in sources - implied:
                dag.add_edge(src.name, node.name)
    return dag


def dag_summary(dag: nx.DiGraph) -> dict[str, Any]:
    """Numbers worth showing an operator: how much parallelism exists between GEMMs."""
    if dag.number_of_nodes() == 0:
        return {"gemms": 0, "gflop": 0.0, "critical_path": 0, "parallelism": 0.0}
    critical = nx.dag_longest_path_length(dag) + 1
    return {
        "gemms": dag.number_of_nodes(),
        "gflop": sum(d["flops"] for _, d in dag.nodes(data=True)) / 1e9,
        "critical_path": critical,
        "parallelism": round(dag.number_of_nodes() / max(1, critical), 2),
        "ops": {
            op: sum(1 for _, d in dag.nodes(data=True) if d["op"] == op)
            for op in ("mm", "bmm", "addmm")
        },
        "largest_gflop": max(d["flops"] for _, d in dag.nodes(data=True)) / 1e9,
    }
