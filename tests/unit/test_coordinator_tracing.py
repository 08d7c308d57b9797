"""Tracing a training step into an aten graph, its GEMMs and the GEMM DAG."""

from __future__ import annotations

import itertools
from typing import Any

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from support.small_nets import BatchNormNet
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, is_fake
from torch.fx import Node

from coordinator.jobs.tiny_gpt import make_job
from coordinator.step.job import Job
from coordinator.step.tracing import (
    GEMM_OPS,
    StepTracer,
    TracedStep,
    dag_summary,
    gemm_dag,
    gemm_info,
    shape_key,
    trace_step,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gpt() -> tuple[Job, TracedStep, dict[str, torch.Tensor]]:
    job = make_job(seed=0)
    before = {name: p.detach().clone() for name, p in job.model.named_parameters()}
    inputs, targets = job.next_batch()
    traced = trace_step(job, inputs, targets)
    return job, traced, before


def small_job(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Job:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Job(model=model, loss_fn=F.cross_entropy, optimizer=opt, batches=[(x, y)])


# ---- the tiny GPT ------------------------------------------------------------------------


def test_tiny_gpt_traces_to_39_gemms_with_a_critical_path_of_26(gpt: Any) -> None:
    _, traced, _ = gpt
    ops = [GEMM_OPS[n.target] for n in traced.gemm_nodes()]
    assert (len(ops), ops.count("mm"), ops.count("bmm"), ops.count("addmm")) == (39, 19, 12, 8)
    dag = gemm_dag(traced)
    summary = dag_summary(dag)
    assert summary["gemms"] == 39
    assert summary["ops"] == {"mm": 19, "bmm": 12, "addmm": 8}
    assert summary["critical_path"] == 26
    assert summary["parallelism"] == round(39 / 26, 2)
    infos = [gemm_info(n) for n in traced.gemm_nodes()]
    assert summary["gflop"] == pytest.approx(sum(i.flops for i in infos) / 1e9)
    assert summary["largest_gflop"] == pytest.approx(max(i.flops for i in infos) / 1e9)


def test_the_trace_leaves_the_model_untouched(gpt: Any) -> None:
    job, _, before = gpt
    for name, p in job.model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None, name
    assert job.model.training


def test_traced_signature_is_params_buffers_batch_to_grads_and_loss(gpt: Any) -> None:
    job, traced, _ = gpt
    model = job.model
    assert traced.param_names == tuple(n for n, _ in model.named_parameters())
    assert traced.buffer_names == tuple(n for n, _ in model.named_buffers())
    # The tied head weight is one parameter, not two.
    assert "head.weight" not in traced.param_names and "tok.weight" in traced.param_names
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(traced.param_names) + len(traced.buffer_names) + 2
    (output,) = [n for n in traced.graph.nodes if n.op == "output"]
    assert len(output.args[0]) == len(traced.param_names) + 1


def test_gemm_info_matches_each_nodes_traced_value(gpt: Any) -> None:
    _, traced, _ = gpt
    for node in traced.gemm_nodes():
        info = gemm_info(node)
        out = node.meta["val"]
        if info.op == "bmm":
            assert tuple(out.shape) == (info.batch, info.m, info.n)
        else:
            assert info.batch == 1 and tuple(out.shape) == (info.m, info.n)
        assert info.flops == 2 * info.batch * info.m * info.n * info.k
        assert info.op == GEMM_OPS[node.target]


def _gemm_ancestors(traced: TracedStep) -> dict[str, set[str]]:
    """For each GEMM, every GEMM whose output reaches it (walking the fx graph backwards)."""
    gemms = set(traced.gemm_nodes())
    result = {}
    for node in gemms:
        seen: set[Node] = set()
        stack = list(node.all_input_nodes)
        while stack:
            cur = stack.pop()
            if cur not in seen:
                seen.add(cur)
                stack.extend(cur.all_input_nodes)
        result[node.name] = {n.name for n in seen & gemms}
    return result


def test_gemm_dag_is_the_transitive_reduction_of_gemm_reachability(gpt: Any) -> None:
    _, traced, _ = gpt
    dag = gemm_dag(traced)
    assert nx.is_directed_acyclic_graph(dag)
    ancestors = _gemm_ancestors(traced)
    assert set(dag.nodes) == set(ancestors)
    for u, v in itertools.permutations(dag.nodes, 2):
        assert nx.has_path(dag, u, v) == (u in ancestors[v]), (u, v)
    reduced = nx.transitive_reduction(dag)
    assert set(reduced.edges) == set(dag.edges)


# ---- small models with known answers -------------------------------------------------------


def test_two_layer_mlp_dag_table() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))
    x, y = torch.randn(8, 12), torch.randint(0, 4, (8,))
    traced = trace_step(small_job(model, x, y), x, y)
    infos = {n.name: gemm_info(n) for n in traced.gemm_nodes()}
    # forward h = x W1^T, logits = h W2^T; backward dW2, dh, dW1 (x needs no gradient).
    assert {(i.m, i.n, i.k) for i in infos.values()} == {
        (8, 16, 12),
        (8, 4, 16),
        (4, 16, 8),
        (8, 16, 4),
        (16, 12, 8),
    }
    dag = gemm_dag(traced)
    by_shape = {(i.m, i.n, i.k): name for name, i in infos.items()}
    h, logits, d_w2, d_h, d_w1 = (
        by_shape[s] for s in [(8, 16, 12), (8, 4, 16), (4, 16, 8), (8, 16, 4), (16, 12, 8)]
    )
    assert set(dag.edges) == {(h, logits), (logits, d_w2), (logits, d_h), (d_h, d_w1)}
    assert dag_summary(dag)["critical_path"] == 4
    assert dag.nodes[h]["flops"] == 2 * 8 * 16 * 12


def test_a_model_without_gemms_has_an_empty_dag() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    x, y = torch.randn(3, 4), torch.randint(0, 4, (3,))
    traced = trace_step(small_job(Scale(), x, y), x, y)
    assert traced.gemm_nodes() == []
    assert dag_summary(gemm_dag(traced)) == {
        "gemms": 0,
        "gflop": 0.0,
        "critical_path": 0,
        "parallelism": 0.0,
    }


# ---- the per-shape cache -------------------------------------------------------------------


class CountingTrace:
    """Distinct traces of one graph, one per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []
        self.graph = torch.fx.symbolic_trace(nn.Identity())

    def __call__(self, job: Job, inputs: Any, targets: Any) -> TracedStep:
        self.calls.append((inputs, targets))
        return TracedStep(self.graph, (), (), pytree.tree_flatten(None)[1], ())


def test_step_tracer_traces_once_per_input_shape_and_dtype() -> None:
    trace = CountingTrace()
    tracer = StepTracer(make_job(), trace)
    x, y = torch.zeros(16, 64, dtype=torch.long), torch.zeros(16, 64, dtype=torch.long)
    first = tracer.get(x, y)
    # Same shapes, other values: traced once more to check that the model's Python
    # decides alike, then served from the cache.
    assert tracer.get(x + 1, y + 2) is first and len(trace.calls) == 2
    assert tracer.get(x + 2, y + 3) is first and len(trace.calls) == 2
    shorter = tracer.get(x[:, :32], y[:, :32])  # another shape: retrace
    assert shorter is not first and len(trace.calls) == 3
    assert tracer.get(x[:8], y[:8]) is not first and len(trace.calls) == 4
    assert tracer.get(x.int(), y) is not first and len(trace.calls) == 5  # dtype counts
    assert tracer.get(x, y[:, :32]) is not first and len(trace.calls) == 6  # targets count
    assert tracer.get(x[:, :32] * 3, y[:, :32]) is shorter and len(trace.calls) == 7
    # Every shape seen and checked before is served from the cache.
    assert tracer.get(x[:, :32] * 3, y[:, :32]) is shorter
    assert tracer.get(x, y) is first
    assert len(trace.calls) == 7


def test_step_tracer_with_the_real_trace_serves_a_second_batch_from_the_cache() -> None:
    job = make_job(seed=1)
    calls = []

    def counted(job_: Job, inputs: Any, targets: Any) -> TracedStep:
        calls.append(inputs.shape)
        return trace_step(job_, inputs, targets)

    tracer = StepTracer(job, counted)
    first = tracer.get(*job.next_batch())
    second = tracer.get(*job.next_batch())  # traced again: the same graph
    third = tracer.get(*job.next_batch())
    assert second is first and third is first and len(calls) == 2
    assert len(first.gemm_nodes()) == 39


def test_shape_key_tells_structure_shape_dtype_and_plain_values_apart() -> None:
    t = torch.zeros(2, 3)
    assert shape_key((t, t)) == shape_key((t + 1, t - 1))
    assert shape_key((t, t)) != shape_key([t, t])
    assert shape_key((t, t)) != shape_key((t, t.double()))
    assert shape_key((t, t)) != shape_key((t, t.T))
    assert shape_key(((t, 3), t)) != shape_key(((t, 4), t))
    assert shape_key({"x": t}) != shape_key({"y": t})


# ---- buffers and randomness ------------------------------------------------------------------


def test_batchnorm_model_traces_and_the_trace_leaves_its_buffers_alone() -> None:
    torch.manual_seed(0)
    model = BatchNormNet()
    x, y = torch.randn(8, 12), torch.randint(0, 4, (8,))
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    traced = trace_step(small_job(model, x, y), x, y)
    assert traced.buffer_names == tuple(buffers)
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), f"tracing changed buffer {name}"


def test_tracing_does_not_consume_the_global_rng() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    job = small_job(model, x, y)
    state = torch.random.get_rng_state()
    trace_step(job, x, y)
    assert torch.equal(torch.random.get_rng_state(), state)


class _Watched(nn.Module):
    """A linear layer that notes whether each forward saw real data."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.real: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.real.append(not is_fake(x))
        return self.linear(x)


def test_the_trace_runs_the_step_on_fake_tensors_not_on_the_data() -> None:
    # A real trace computes the whole step and holds all its activations and gradients
    # at once: more memory than training itself.
    model = _Watched()
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    traced = trace_step(small_job(model, x, y), x, y)
    assert model.real == [False]
    vals = [n.meta.get("val") for n in traced.graph.nodes if n.op == "call_function"]
    assert vals and all(isinstance(v, FakeTensor) for v in vals if isinstance(v, torch.Tensor))


def test_a_step_whose_shape_rules_refuse_fake_tensors_is_traced_on_real_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _Watched()
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    real_forward = model.forward

    def strict(x: torch.Tensor) -> torch.Tensor:
        if is_fake(x):
            raise RuntimeError("no shape rule for this op on fake tensors")
        return real_forward(x)

    monkeypatch.setattr(model, "forward", strict)
    traced = trace_step(small_job(model, x, y), x, y)
    assert model.real == [True]
    assert [GEMM_OPS[n.target] for n in traced.gemm_nodes()].count("addmm") == 1
