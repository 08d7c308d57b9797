"""The dataflow executor against plain eager torch.

Without an offload it must reproduce eager loss and gradients bit for bit; with an offload
that finishes GEMMs on other threads, in random order and after random delays, within
rtol 1e-5 / atol 1e-6. Failures, cancellation and declined GEMMs are covered too.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from support.small_nets import BatchNormNet
from torch import nn

from coordinator.jobs.tiny_gpt import make_job
from coordinator.step.cpu_costs import COSTS
from coordinator.step.executor import DataflowExecutor, GemmDone, StepCancelled, finish_addmm
from coordinator.step.job import Job
from coordinator.step.tracing import TracedStep, trace_step

pytestmark = pytest.mark.timeout(60)
GPT_GEMMS = 39


# ---- fake offloads --------------------------------------------------------------------


class ThreadedOffload:
    """Completes GEMMs on background threads, in random order, after random delays.

    ``decline(name, op)`` -> True makes ``start`` return False (the executor runs it).
    ``fail(name)`` -> an exception to deliver instead of the product.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        threads: int = 3,
        max_delay_s: float = 0.002,
        decline: Callable[[str, str], bool] = lambda name, op: False,
        fail: Callable[[str], BaseException | None] = lambda name: None,
        on_start: Callable[[int], None] = lambda count: None,
    ) -> None:
        self._on_start = on_start
        self._rng = random.Random(seed)
        self._max_delay_s = max_delay_s
        self._decline = decline
        self._fail = fail
        self._pending: list[tuple[str, str, torch.Tensor, torch.Tensor, GemmDone]] = []
        self._cond = threading.Condition()
        self._closed = False
        self.started: list[tuple[str, str]] = []
        self.declined: list[str] = []
        self.completion_order: list[str] = []
        self._threads = [
            threading.Thread(target=self._serve, daemon=True, name=f"fake-offload-{i}")
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def start(self, name: str, op: str, a: torch.Tensor, b: torch.Tensor, done: GemmDone) -> bool:
        assert op in ("mm", "bmm")
        assert a.dim() == b.dim() == (3 if op == "bmm" else 2)
        assert a.shape[-1] == b.shape[-2]
        if self._decline(name, op):
            self.declined.append(name)
            return False
        with self._cond:
            self.started.append((name, op))
            self._pending.append((name, op, a, b, done))
            self._cond.notify()
        self._on_start(len(self.started))
        return True

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                # A random pending GEMM, not the oldest: completions arrive out of order.
                item = self._pending.pop(self._rng.randrange(len(self._pending)))
                delay = self._rng.uniform(0, self._max_delay_s)
            time.sleep(delay)
            name, op, a, b, done = item
            error = self._fail(name)
            with self._cond:
                self.completion_order.append(name)
            done(error if error is not None else torch.matmul(a, b))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(5)


class SilentOffload:
    """Accepts every GEMM and never answers; calls ``on_start(count)`` on each start."""

    def __init__(self, on_start: Callable[[int], None] = lambda count: None) -> None:
        self.count = 0
        self._on_start = on_start

    def start(self, name: str, op: str, a: torch.Tensor, b: torch.Tensor, done: GemmDone) -> bool:
        self.count += 1
        self._on_start(self.count)
        return True


# ---- references -------------------------------------------------------------------------


def flat_args(model: nn.Module, traced: TracedStep, inputs: Any, targets: Any) -> list[Any]:
    """What the trainer passes: params, buffers (the real ones), then the batch's leaves."""
    params = [p.detach() for _, p in model.named_parameters()]
    assert len(params) == len(traced.param_names)
    return params + list(model.buffers()) + pytree.tree_leaves((inputs, targets))


def eager(model: nn.Module, loss_fn: Any, inputs: Any, targets: Any) -> list[torch.Tensor]:
    """Eager grads (in named_parameters order) and loss, as the traced graph returns them."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    grads = [p.grad.detach().clone() for _, p in model.named_parameters()]
    model.zero_grad(set_to_none=True)
    return [*grads, loss.detach()]


def assert_exact(got: list[Any], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, i
        assert torch.equal(g, w), f"output {i} differs by {(g - w).abs().max()}"


def assert_close(got: list[Any], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"output {i}")


@pytest.fixture(scope="module")
def gpt() -> tuple[Job, TracedStep, list[Any], list[torch.Tensor]]:
    job = make_job(seed=0)
    inputs, targets = job.next_batch()
    traced = trace_step(job, inputs, targets)
    want = eager(job.model, job.loss_fn, inputs, targets)
    return job, traced, flat_args(job.model, traced, inputs, targets), want


# ---- tiny GPT --------------------------------------------------------------------------------


def test_without_offload_the_step_equals_eager_exactly(gpt: Any) -> None:
    _, traced, flat, want = gpt
    got, stats = DataflowExecutor(None).run(traced, flat)
    assert_exact(got, want)
    assert (stats.gemms_offloaded, stats.gemms_local, stats.max_gemms_in_flight) == (
        0,
        GPT_GEMMS,
        0,
    )
    again, _ = DataflowExecutor(None).run(traced, flat)  # inputs were not consumed
    assert_exact(again, want)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_out_of_order_threaded_offload_matches_eager(gpt: Any, seed: int) -> None:
    _, traced, flat, want = gpt
    offload = ThreadedOffload(seed)
    try:
        got, stats = DataflowExecutor(offload, poll_s=0.01).run(traced, flat)
    finally:
        offload.close()
    assert_close(got, want)
    assert stats.gemms_offloaded == GPT_GEMMS and stats.gemms_local == 0
    assert stats.max_gemms_in_flight > 1  # dX and dW of a layer go out together
    assert sorted(offload.completion_order) == sorted(n for n, _ in offload.started)
    assert {op for _, op in offload.started} == {"mm", "bmm"}  # addmm goes out as mm


def test_declined_gemms_run_locally_and_are_counted(gpt: Any) -> None:
    _, traced, flat, want = gpt
    offload = ThreadedOffload(3, decline=lambda name, op: op == "bmm" or name.endswith("1"))
    try:
        got, stats = DataflowExecutor(offload, poll_s=0.01).run(traced, flat)
    finally:
        offload.close()
    assert_close(got, want)
    assert stats.gemms_local == len(offload.declined) > 12
    assert stats.gemms_offloaded == len(offload.started) == GPT_GEMMS - len(offload.declined)


def test_declining_every_gemm_is_exact(gpt: Any) -> None:
    _, traced, flat, want = gpt
    offload = ThreadedOffload(decline=lambda name, op: True)
    try:
        got, stats = DataflowExecutor(offload).run(traced, flat)
    finally:
        offload.close()
    assert_exact(got, want)
    assert (stats.gemms_local, stats.gemms_offloaded) == (GPT_GEMMS, 0)


def test_gemms_run_here_are_timed_as_kept_gemms(gpt: Any) -> None:
    # The per-step breakdown names them, apart from the rest of the training thread.
    _, traced, flat, _ = gpt
    offload = ThreadedOffload(decline=lambda name, op: op == "bmm")
    before = COSTS.snapshot().get("kept_gemms", 0.0)
    try:
        _, stats = DataflowExecutor(offload).run(traced, flat)
    finally:
        offload.close()
    assert stats.gemms_local > 0
    assert COSTS.snapshot().get("kept_gemms", 0.0) > before


def test_an_exception_from_the_offload_is_raised_by_run(gpt: Any) -> None:
    _, traced, flat, _ = gpt

    class TileLost(RuntimeError):
        pass

    victim = traced.gemm_nodes()[5].name
    offload = ThreadedOffload(
        fail=lambda name: TileLost(f"lost {name}") if name == victim else None
    )
    try:
        with pytest.raises(TileLost, match=f"lost {victim}"):
            DataflowExecutor(offload, poll_s=0.01).run(traced, flat)
    finally:
        offload.close()


def test_cancel_mid_run_raises_step_cancelled(gpt: Any) -> None:
    _, traced, flat, _ = gpt
    cancel = threading.Event()
    offload = ThreadedOffload(1, on_start=lambda count: cancel.set() if count == 5 else None)
    started = time.monotonic()
    try:
        with pytest.raises(StepCancelled):
            DataflowExecutor(offload, poll_s=0.01).run(traced, flat, cancel)
    finally:
        offload.close()
    assert time.monotonic() - started < 5
    assert 5 <= len(offload.started) < GPT_GEMMS


def test_cancel_set_from_another_thread_while_waiting(gpt: Any) -> None:
    _, traced, flat, _ = gpt
    cancel = threading.Event()
    offloaded = threading.Event()
    offload = SilentOffload(on_start=lambda count: offloaded.set())

    def cancel_once_waiting() -> None:
        # Once a GEMM is out (and never answered) the executor can only wait for it;
        # a fixed delay instead could fire before the first GEMM on a loaded machine.
        if offloaded.wait(60):
            time.sleep(0.05)
        cancel.set()

    canceller = threading.Thread(target=cancel_once_waiting, daemon=True)
    canceller.start()
    with pytest.raises(StepCancelled):
        DataflowExecutor(offload, poll_s=0.01).run(traced, flat, cancel)
    canceller.join(5)
    assert offload.count >= 1


def test_a_cancel_set_before_the_run_starts_nothing(gpt: Any) -> None:
    _, traced, flat, _ = gpt
    cancel = threading.Event()
    cancel.set()
    offload = SilentOffload()
    with pytest.raises(StepCancelled):
        DataflowExecutor(offload).run(traced, flat, cancel)
    assert offload.count == 0


# ---- small models ---------------------------------------------------------------------------


class TwoBranch(nn.Module):
    """Two independent linear branches of the same input, summed."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(24, 32)
        self.right = nn.Linear(24, 32, bias=False)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.left(x)) + torch.sigmoid(self.right(x)))


def test_independent_gemms_are_in_flight_together() -> None:
    torch.manual_seed(3)
    model = TwoBranch()
    x, y = torch.randn(16, 24), torch.randint(0, 5, (16,))
    job = Job(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), [(x, y)])
    traced = trace_step(job, x, y)
    want = eager(model, F.cross_entropy, x, y)
    flat = flat_args(model, traced, x, y)
    assert_exact(DataflowExecutor(None).run(traced, flat)[0], want)
    offload = ThreadedOffload(7, max_delay_s=0.005)
    try:
        got, stats = DataflowExecutor(offload, poll_s=0.01).run(traced, flat)
    finally:
        offload.close()
    assert_close(got, want)
    # Both forward branches start before either finishes.
    assert stats.max_gemms_in_flight >= 2
    first_two = {n for n, _ in offload.started[:2]}
    assert len(first_two) == 2


@pytest.mark.parametrize("offloaded", [False, True])
def test_buffers_mutated_in_place_match_eager(offloaded: bool) -> None:
    torch.manual_seed(0)
    model = BatchNormNet()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 12), torch.randint(0, 4, (8,))
    job = Job(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), [(x, y)])
    traced = trace_step(job, x, y)
    assert any(n.target == torch.ops.aten.copy_.default for n in traced.graph.nodes)
    reference.train()
    offload = ThreadedOffload(5) if offloaded else None
    try:
        for _ in range(2):  # two steps: the second reads the stats the first wrote
            want = eager(reference, F.cross_entropy, x, y)
            flat = flat_args(model, traced, x, y)
            got, _ = DataflowExecutor(offload, poll_s=0.01).run(traced, flat)
            (assert_close if offloaded else assert_exact)(got, want)
    finally:
        if offload is not None:
            offload.close()
    for (name, b), (_, ref_b) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        if offloaded:
            torch.testing.assert_close(b, ref_b, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(b, ref_b), name
    assert int(model.bn.num_batches_tracked) == 2


class RandomBranches(nn.Module):
    """Random ops whose inputs come from GEMMs: they become ready in whatever order the
    workers answer, yet must draw from the RNG in eager order."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(24, 32)
        self.right = nn.Linear(24, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left = torch.bernoulli(torch.sigmoid(self.left(x))) * self.left(x)
        right = F.dropout(self.right(x), p=0.3, training=True)
        return self.head(left + right)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_draw_in_eager_order_whatever_order_gemms_finish(seed: int) -> None:
    torch.manual_seed(11)
    model = RandomBranches()
    x, y = torch.randn(16, 24), torch.randint(0, 5, (16,))
    job = Job(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), [(x, y)])
    traced = trace_step(job, x, y)
    torch.manual_seed(100)
    want = eager(model, F.cross_entropy, x, y)
    torch.manual_seed(100)
    offload = ThreadedOffload(seed, max_delay_s=0.01)
    try:
        got, _ = DataflowExecutor(offload, poll_s=0.01).run(traced, flat_args(model, traced, x, y))
    finally:
        offload.close()
    assert_close(got, want)


def test_local_graph_without_gemms_or_offload_calls() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.linspace(0.5, 2.0, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    model = Scale()
    x, y = torch.randn(3, 4), torch.randint(0, 4, (3,))
    job = Job(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), [(x, y)])
    traced = trace_step(job, x, y)
    offload = SilentOffload()
    got, stats = DataflowExecutor(offload).run(traced, flat_args(model, traced, x, y))
    assert_exact(got, eager(model, F.cross_entropy, x, y))
    assert offload.count == 0 and stats.max_gemms_in_flight == 0


@pytest.mark.parametrize(
    ("bias_shape", "kwargs"),
    [((5,), {}), ((3, 5), {"beta": 2.0}), ((1, 5), {"alpha": 0.5, "beta": -1.5}), ((3, 1), {})],
)
def test_finish_addmm_equals_torch_addmm(bias_shape: tuple[int, ...], kwargs: Any) -> None:
    gen = torch.Generator().manual_seed(7)
    bias, a, b = (torch.randn(s, generator=gen) for s in (bias_shape, (3, 4), (4, 5)))
    kept = bias.clone()
    out = finish_addmm(a @ b, bias, kwargs)
    torch.testing.assert_close(out, torch.addmm(bias, a, b, **kwargs), rtol=1e-6, atol=1e-6)
    assert torch.equal(bias, kept)  # the bias is read, never written
