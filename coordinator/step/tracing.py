"""Trace one training step (forward + backward) into an aten graph, and find its GEMMs.

``make_fx`` over a functional step (``functional_call`` + ``grad_and_value``) gives the
whole step as aten ops, with every GEMM as ``aten.mm``, ``aten.bmm`` or ``aten.addmm``;
fused attention and convolutions are lowered to GEMMs on the way (``coordinator.step.lowering``).
The step is functionalized so that no node mutates another's output: the dataflow
executor may then run independent nodes in any order. Mutations of inputs (e.g.
BatchNorm's running statistics) remain as copies into buffers; the executor orders them.

A step that cannot be one graph (Python that branches on a tensor's value) raises
``CaptureError`` with the reason in words; the trainer then runs it eagerly
(``coordinator.step.eager``), still sending every GEMM to workers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import networkx as nx
import torch
import torch.utils._pytree as pytree
from torch.func import functional_call, functionalize, grad_and_value
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

from common.unfold import Unfold
from coordinator.step.dropout import EagerDropout
from coordinator.step.flops import node_flops, node_label, op_name
from coordinator.step.hooks import hooks_reason, untraced_hooks
from coordinator.step.job import Job, JobError
from coordinator.step.lowering import LOWERINGS, unfold_spec
from coordinator.step.one_hot import GraphOneHot

log = logging.getLogger("cleave.coordinator")
aten = torch.ops.aten
GEMM_OPS = {
    aten.mm.default: "mm",
    aten.bmm.default: "bmm",
    aten.addmm.default: "addmm",
    # A convolution's GEMM over the patches of an image block (coordinator.step.lowering).
    torch.ops.cleave.unfold_mm.default: "unfold_mm",
}


def gemm_operands(target: Any, args: Sequence[Any]) -> tuple[Any, Any, Unfold | None]:
    """A GEMM call's ``(a, b, unfold)``: ``a @ b``, with ``unfold`` when one of them is an
    image block standing for its patch matrix. ``args`` may be nodes or values."""
    op = GEMM_OPS[target]
    if op == "addmm":
        return args[1], args[2], None
    if op == "unfold_mm":
        return args[0], args[1], unfold_spec(*args[2:7])
    return args[0], args[1], None


def _dense_operands(node: Node) -> bool:
    a, b, _ = gemm_operands(node.target, node.args)
    vals = [x.meta.get("val") if isinstance(x, Node) else x for x in (a, b)]
    return all(isinstance(v, torch.Tensor) and v.layout == torch.strided for v in vals)


@dataclass(frozen=True)
class TracedStep:
    """One traced training step.

    Call signature of the graph (flat): ``*params, *buffers, *input_leaves`` ->
    ``[*grads, loss]`` with params/buffers in ``param_names``/``buffer_names`` order and
    grads in ``grad_names`` order: the parameters that required gradients when traced
    (a frozen one takes none, as in local torch, and costs no GEMM).
    """

    graph_module: GraphModule
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    batch_spec: pytree.TreeSpec
    grad_names: tuple[str, ...]

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def gemm_nodes(self) -> list[Node]:
        """The GEMMs workers can take: sparse operands (no dense blocks to cut) run here."""
        return [
            n
            for n in self.graph.nodes
            if n.op == "call_function" and n.target in GEMM_OPS and _dense_operands(n)
        ]

    def flops(self) -> dict[Node, int]:
        """Every node's FLOPs (``torch.utils.flop_counter`` conventions), counted once."""
        cached: dict[Node, int] | None = self.graph_module.meta.get("cleave_flops")
        if cached is None:
            cached = {n: node_flops(n) for n in self.graph.nodes}
            self.graph_module.meta["cleave_flops"] = cached
        return cached

    def gradients_flow(self) -> tuple[bool, ...]:
        """Per parameter of ``grad_names``, whether its gradient comes from the loss.
        One that the loss does not depend on (a head the step does not use, a weight
        read under no_grad) gets zeros from the trace where local torch leaves its
        ``.grad`` None, and the optimizer then skips it: no weight decay, no momentum,
        no state."""
        cached: tuple[bool, ...] | None = self.graph_module.meta.get("cleave_grads_flow")
        if cached is None:
            (output,) = (n for n in self.graph.nodes if n.op == "output")
            *grads, loss = output.args[0]
            after_loss: set[Node] = set()
            frontier = [loss]
            while frontier:
                for user in frontier.pop().users:
                    if user not in after_loss:
                        after_loss.add(user)
                        frontier.append(user)
            cached = tuple(g in after_loss for g in grads)
            self.graph_module.meta["cleave_grads_flow"] = cached
        return cached

    def labels(self) -> dict[Node, str]:
        """The nodes whose FLOPs are tallied under another name than their op's (a
        depthwise convolution), computed once."""
        cached: dict[Node, str] | None = self.graph_module.meta.get("cleave_labels")
        if cached is None:
            cached = {}
            for n in self.graph.nodes:
                if n.op == "call_function" and (label := node_label(n)) != op_name(n.target):
                    cached[n] = label
            self.graph_module.meta["cleave_labels"] = cached
        return cached


class CaptureError(Exception):
    """The step cannot be traced into one graph; ``reason`` says why, in words."""

    def __init__(self, reason: str, cause: BaseException) -> None:
        super().__init__(reason)
        self.reason = reason
        self.cause = cause


def _user_frame(exc: BaseException) -> str:
    """``file:line`` of the deepest frame of the traceback outside torch: the user's code."""
    tb, where = exc.__traceback__, ""
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if "/torch/" not in path and "/coordinator/" not in path:
            where = f"{path}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _passes_through(exc: BaseException, *parts: str) -> bool:
    """Whether the traceback passes through a file whose path ends in ``parts``."""
    tb = exc.__traceback__
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).parts[-len(parts) :] == parts:
            return True
        tb = tb.tb_next
    return False


def capture_reason(exc: BaseException) -> str:
    """Why make_fx stopped, in words an author of a model can act on."""
    where = _user_frame(exc)
    at = f" (at {where})" if where else ""
    text = str(exc)
    if _passes_through(exc, "torch", "utils", "checkpoint.py"):
        # torch.func refuses checkpointing's saved-tensor hooks (and the reentrant kind's
        # autograd.Function), and its own words point at neither.
        return (
            f"the model uses activation checkpointing{at} (torch.utils.checkpoint, or a "
            "library's gradient_checkpointing_enable()), which torch.func cannot trace. To "
            "capture the whole step, turn it off: here it only saves the coordinator "
            "memory, by computing the forward twice (its GEMMs go to workers twice)"
        )
    data_dependent = any(
        w in text for w in ("_local_scalar_dense", "data-dependent", "data dependent")
    )
    if data_dependent and _passes_through(exc, "torch", "distributions", "distribution.py"):
        return (
            f"a torch.distributions object checks its arguments' values in Python{at}, "
            "a question one graph cannot hold. To capture the whole step, create it with "
            "validate_args=False, or call "
            "torch.distributions.Distribution.set_default_validate_args(False) once"
        )
    if data_dependent:
        return (
            f"the model or loss reads a tensor's value in Python{at}: .item(), .tolist(), "
            "`if tensor:`, .any()/.all() in a condition, or a shape taken from data "
            "(torch.where(cond), x[mask], unique, bincount). One graph "
            "cannot hold a decision that depends on the data. To capture the whole step, "
            "compute it with tensor ops instead (torch.where, masks)"
        )
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"tracing stopped with {type(exc).__name__}{at}: {first[:300]}"


class DataDependentShape(RuntimeError):
    """An op whose result's shape comes from the data, met while tracing."""


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise DataDependentShape(f"data-dependent output shape: {what}")

    return refuse


def _index(self: torch.Tensor, indices: Sequence[torch.Tensor | None]) -> Any:
    if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
        raise DataDependentShape("data-dependent output shape: indexing with a boolean mask")
    return NotImplemented  # integer indices: a shape the graph can hold


# An op whose result's shape comes from the data (torch.where(cond), x[mask], unique,
# bincount) has no shape on fake tensors, and a trace on real data would leave that one
# batch's shapes in the graph, so the next batch would fail deep inside torch. Such a
# step runs eagerly.
_TRACE_TABLE: dict[Any, Callable[..., Any]] = {
    **LOWERINGS,
    aten.nonzero.default: _refuse("nonzero / torch.where(cond) / argwhere"),
    aten.masked_select.default: _refuse("masked_select"),
    aten.bincount.default: _refuse("bincount"),
    aten.repeat_interleave.Tensor: _refuse("repeat_interleave with tensor repeats"),
    aten._unique.default: _refuse("unique"),
    aten._unique2.default: _refuse("unique"),
    aten.unique_dim.default: _refuse("unique"),
    aten.unique_consecutive.default: _refuse("unique_consecutive"),
    aten.index.Tensor: _index,
}


def shape_key(batch: Any) -> tuple[Any, ...]:
    """Traces are valid per input shape and dtype: the cache key. A value that is not a
    tensor is part of the key, or, where it cannot be (an unhashable one: a numpy
    array), stands as ``Untraceable``."""
    leaves, spec = pytree.tree_flatten(batch)
    return (str(spec), tuple(_leaf_key(x) for x in leaves))


@dataclass(frozen=True)
class Untraceable:
    """A batch value a trace would keep as a constant though it may differ per batch."""

    kind: str


def _leaf_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype)
    try:
        hash(x)
    except TypeError:
        return Untraceable(type(x).__qualname__)
    return (type(x), x)


@contextlib.contextmanager
def _compiling(on: bool) -> Iterator[None]:
    """``torch.compiler.is_compiling()`` reads ``on`` inside, as torch.export's own make_fx
    trace sets it. Libraries read it to take the path their authors wrote for graph
    capture: transformers then builds the attention mask from the padding mask instead of
    asking in Python whether the padding mask is all ones, a question one graph cannot
    hold."""
    was = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = on
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = was


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensor logs a stack trace for each op whose shape rule refuses its inputs
    before it raises; the next attempt handles that, so the operator need not read it."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


# The order a step is traced in: the model's own path first, the one local torch runs;
# the path it takes for torch.compile only where its own path cannot be one graph (some
# libraries' compile paths hold ops torch.func cannot trace). On fake tensors first:
# shapes only, no arithmetic, and none of the step's activations held at once (a real
# trace holds all of them and every gradient on top of the model's own memory: the
# coordinator's peak). A few ops' shape rules are stricter than their CPU kernels
# (grouped_mm asks for bf16): those steps are traced on real data, as they run.
_ATTEMPTS: tuple[tuple[Literal["real", "fake"], bool], ...] = (
    ("fake", False),
    ("fake", True),
    ("real", False),
    ("real", True),
)


def trace_step(job: Job, inputs: Any, targets: Any) -> TracedStep:
    model = job.model
    hooked = untraced_hooks(model)
    if hooked:
        raise CaptureError(hooks_reason(hooked), RuntimeError("; ".join(hooked)))
    param_names = tuple(name for name, _ in model.named_parameters())
    grad_names = tuple(name for name, p in model.named_parameters() if p.requires_grad)
    buffer_names = tuple(name for name, _ in model.named_buffers())
    params = [p.detach() for _, p in model.named_parameters()]
    # A trace on real data (the fallback below) runs the step once: clones keep it from
    # updating the real buffers (BatchNorm statistics would move twice on the first step).
    buffers = [b.detach().clone() for _, b in model.named_buffers()]
    leaves, batch_spec = pytree.tree_flatten((inputs, targets))
    n_params, n_buffers = len(params), len(buffers)

    def step(*flat: Any) -> list[torch.Tensor]:
        p = dict(zip(param_names, flat[:n_params], strict=True))
        b = dict(zip(buffer_names, flat[n_params : n_params + n_buffers], strict=True))
        x, y = pytree.tree_unflatten(list(flat[n_params + n_buffers :]), batch_spec)

        # Buffers and frozen parameters go in as an argument (not captured) so that
        # in-place updates to them are allowed under grad_and_value; gradients are taken
        # for p_ only.
        def loss_of(p_: dict[str, torch.Tensor], rest: dict[str, torch.Tensor]) -> torch.Tensor:
            with job.autocast_context(), EagerDropout(), GraphOneHot(), _compiling(compiling):
                args, kwargs = job.model_arguments(x)
                return job.loss_of(functional_call(model, (p_, rest), args, kwargs), y)

        trained = {name: p[name] for name in grad_names}
        rest = {**{n: t for n, t in p.items() if n not in trained}, **b}
        grads, loss = grad_and_value(loss_of)(trained, rest)
        return [grads[name] for name in grad_names] + [loss]

    compiling = False

    def traced(mode: Literal["real", "fake"], as_compiled: bool) -> GraphModule:
        nonlocal compiling
        compiling = as_compiled
        # The trace draws from the global RNG (dropout masks) like a real step would;
        # forking it leaves the RNG stream to the real steps, as in local training.
        with torch.random.fork_rng(devices=[]), _quiet_fake_tensor_log():
            return make_fx(  # type: ignore[no-any-return]
                functionalize(step, remove="mutations"),
                decomposition_table=_TRACE_TABLE,
                tracing_mode=mode,
            )(*params, *buffers, *leaves)

    was_training = model.training
    model.train()
    failed: list[Exception] = []
    try:
        for mode, as_compiled in _ATTEMPTS:
            try:
                gm = traced(mode, as_compiled)
                break
            except JobError:
                raise
            except Exception as exc:  # noqa: BLE001 - the next attempt may succeed
                log.debug("tracing (%s, compiling %s) failed: %s", mode, as_compiled, exc)
                failed.append(exc)
        else:
            # The model's own path on real data says best what the author can change.
            own = failed[_ATTEMPTS.index(("real", False))]
            raise CaptureError(capture_reason(own), own) from own
    finally:
        model.train(was_training)
    return TracedStep(gm, param_names, buffer_names, batch_spec, grad_names)


class StepTracer:
    """Traces once per input shape and reuses the graph for every later batch of it.

    ``get`` returns None for shapes whose step cannot be captured (``CaptureError``):
    those steps run eagerly. The reason is logged once per shape, not every step.

    A trace runs the model's Python once, so a decision it makes on anything but tensors
    (a counter in an attribute, Python's ``random`` in layer-drop code) would be kept for
    every later step, where local torch decides again each time. The second step of a
    shape is traced once more: a graph that differs from the first (its code or its
    constants) runs that step, and the shape runs eagerly from then on."""

    def __init__(self, job: Job, trace: Callable[[Job, Any, Any], TracedStep] = trace_step):
        self._job = job
        self._trace = trace
        self._cache: dict[tuple[Any, ...], TracedStep | None] = {}
        self._checked: set[tuple[Any, ...]] = set()
        self.failures: dict[tuple[Any, ...], CaptureError] = {}

    def get(self, inputs: Any, targets: Any) -> TracedStep | None:
        # A parameter frozen or thawed since (gradual unfreezing), or a hook added or
        # removed, needs another trace.
        model = self._job.model
        frozen = tuple(p.requires_grad for p in model.parameters())
        key = (*shape_key((inputs, targets)), frozen, untraced_hooks(model))
        if key not in self._cache:
            try:
                untraceable = [k.kind for k in key[1] if isinstance(k, Untraceable)]
                if untraceable:
                    raise CaptureError(
                        f"the batch holds a {untraceable[0]}, which is not a tensor: one graph "
                        "would keep this batch's value for every later batch. Make it a "
                        "tensor to capture the whole step",
                        TypeError(untraceable[0]),
                    )
                self._cache[key] = self._trace(self._job, inputs, targets)
            except CaptureError as exc:
                self._cache[key] = None
                self.failures[key] = exc
                self._warn(exc)
            return self._cache[key]
        first = self._cache[key]
        if first is None or key in self._checked:
            return first
        self._checked.add(key)
        again: TracedStep | None = None
        try:
            again = self._trace(self._job, inputs, targets)
            if _same_graph(first, again):
                return first
            raise CaptureError(
                "the model's Python made other decisions at the next step of the same "
                "shapes (a counter kept in an attribute, Python's random module): one graph "
                "would keep the first step's. Decide with tensor ops (torch.rand, torch.where) "
                "to capture the whole step",
                RuntimeError("the step's graph differs between two traces"),
            )
        except CaptureError as exc:  # another graph, or the Python took an untraceable way
            self._cache[key] = None
            self.failures[key] = exc
            self._warn(exc)
        return again  # this step's own graph, if it has one

    @staticmethod
    def _warn(exc: CaptureError) -> None:
        log.warning(
            "this step cannot be captured as one graph: %s. Cleave runs it eagerly "
            "here instead: every GEMM still goes to workers as the step reaches it "
            "(one at a time, not overlapped), and the rest of the step runs here",
            exc.reason,
        )


def _same_graph(a: TracedStep, b: TracedStep) -> bool:
    """Whether two traces of one step are the same graph: code and lifted constants."""
    if a.graph_module.code != b.graph_module.code:
        return False
    constants_a = dict(a.graph_module.named_buffers())
    constants_b = dict(b.graph_module.named_buffers())
    return constants_a.keys() == constants_b.keys() and all(
        _same_constant(value, constants_b[name]) for name, value in constants_a.items()
    )


def _same_constant(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal contents; a sparse constant (a graph network's adjacency matrix) by its
    nonzeros. Other sparse layouts count as changed: that step then runs eagerly."""
    if a is b:
        return True
    if (a.layout, a.shape, a.dtype) != (b.layout, b.shape, b.dtype):
        return False
    if a.layout == torch.strided:
        return torch.equal(a, b)
    if a.layout == torch.sparse_coo:
        a, b = a.coalesce(), b.coalesce()
        return torch.equal(a.indices(), b.indices()) and torch.equal(a.values(), b.values())
    return False


# ---- GEMM geometry and the GEMM DAG ---------------------------------------------------


@dataclass(frozen=True)
class GemmInfo:
    name: str
    op: str  # "mm", "bmm", "addmm" or "unfold_mm"
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
    a, b, unfold = gemm_operands(node.target, node.args)
    sa, sb = _meta_shape(a), _meta_shape(b)  # type: ignore[arg-type]
    if unfold is not None:
        sa, sb = (
            (unfold.matrix_shape(sa), sb)
            if unfold.operand == "a"
            else (
                sa,
                unfold.matrix_shape(sb),
            )
        )
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
        "ops": _op_counts(dag),
        "largest_gflop": max(d["flops"] for _, d in dag.nodes(data=True)) / 1e9,
    }


def _op_counts(dag: nx.DiGraph) -> dict[str, int]:
    counts = {
        op: sum(1 for _, d in dag.nodes(data=True) if d["op"] == op)
        for op in ("mm", "bmm", "addmm", "unfold_mm")
    }
    # A convolution's GEMMs show only where a model has convolutions.
    return {op: n for op, n in counts.items() if n or op != "unfold_mm"}
