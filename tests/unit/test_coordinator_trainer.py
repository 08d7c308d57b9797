"""The trainer in-process: trace, dataflow step through an offload, optimizer, metrics.

Per-step losses must equal plain ``train_locally`` of the same job and seed: exactly
without an offload, within 1e-5 relative with GEMMs finished on another thread.
"""

from __future__ import annotations

import json
import queue
import random
import threading
from collections import UserDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.recording_offload import RecordingOffload
from support.small_nets import repeated_batch_job
from torch import nn
from torch.nn.utils import prune

import coordinator.step.trainer as trainer_module
from coordinator.jobs.tiny_gpt import make_job
from coordinator.step.cpu_costs import COSTS
from coordinator.step.executor import GemmDone, StepCancelled
from coordinator.step.gemm_names import traced
from coordinator.step.heap import StepTrims
from coordinator.step.job import Job, train_locally
from coordinator.step.trainer import PoolCounters, StepRecord, Trainer

pytestmark = pytest.mark.timeout(60)
GPT_GEMMS = 39


class InThreadOffload:
    """Every GEMM goes to one worker thread, which answers in arrival order.

    Counts a tile per GEMM and its bytes each way, like the server's counters, for
    ``pool_counters``.
    """

    def __init__(self) -> None:
        self.steps_seen: list[int] = []  # from the "s{step}:" label the trainer gives
        self.tiles = 0
        self.bytes_down = self.bytes_up = 0
        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue[tuple[torch.Tensor, torch.Tensor, GemmDone] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def start(self, name: str, op: str, a: torch.Tensor, b: torch.Tensor, done: GemmDone) -> bool:
        label, _, _ = name.partition(":")
        assert label.startswith("s"), name
        step = int(label[1:])
        if not self.steps_seen or self.steps_seen[-1] != step:
            self.steps_seen.append(step)
        self._inbox.put((a, b, done))
        return True

    def _serve(self) -> None:
        while (item := self._inbox.get()) is not None:
            a, b, done = item
            c = torch.matmul(a, b)
            with self._lock:
                self.tiles += 1
                self.bytes_down += a.nbytes + b.nbytes
                self.bytes_up += c.nbytes
            done(c)

    def counters(self) -> PoolCounters:
        with self._lock:
            return PoolCounters(
                tiles_verified=self.tiles,
                reissued=0,
                workers=2,
                bytes_down=self.bytes_down,
                bytes_up=self.bytes_up,
            )

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(5)


def assert_losses_match(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(want), (got, want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rel * abs(w), f"step {step}: trainer {g!r} vs local {w!r}"


def test_three_steps_through_an_offload_match_local_training(tmp_path: Path) -> None:
    want = train_locally(make_job(seed=0), 3)
    offload = InThreadOffload()
    metrics = tmp_path / "metrics.jsonl"
    seen: list[StepRecord] = []
    trainer = Trainer(
        make_job(seed=0), offload, pool_counters=offload.counters, metrics_out=metrics
    )
    try:
        records = trainer.run(3, on_step=seen.append)
    finally:
        offload.close()
    assert seen == records and [r.step for r in records] == [0, 1, 2]
    assert_losses_match([r.loss for r in records], want)
    assert trainer.losses == [r.loss for r in records] and trainer.step == 3
    assert offload.steps_seen == [0, 1, 2]
    assert trainer.dag["gemms"] == GPT_GEMMS and trainer.dag["critical_path"] == 26
    lines = metrics.read_text().splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines):
        row = json.loads(line)
        assert {"step", "loss", "seconds", "tiles", "reissued", "workers"} <= set(row)
        assert row["step"] == i and row["loss"] == records[i].loss
        assert row["tiles"] == GPT_GEMMS and row["reissued"] == 0 and row["workers"] == 2
        assert row["gemms_offloaded"] == GPT_GEMMS and row["gemms_local"] == 0
        assert row["seconds"] > 0
        # The training thread's CPU for the step, by its role (coordinator.step.cpu_costs).
        assert 0 < row["cpu"]["thread:training"] <= row["seconds"] * 2
        # The whole process's CPU, which holds the training thread's; the pool's bytes.
        assert row["process_cpu_s"] >= row["cpu"]["thread:training"] - 0.01
        assert 0 < row["orchestration_cpu_s"] <= row["process_cpu_s"]
        assert row["bytes_down"] > row["bytes_up"] > 0


def test_without_an_offload_training_is_bit_identical_to_local(tmp_path: Path) -> None:
    local_job = make_job(seed=2)
    want = train_locally(local_job, 3)
    job = make_job(seed=2)
    records = Trainer(job, None).run(3)
    assert [r.loss for r in records] == want
    for (name, p), (_, q) in zip(
        job.model.named_parameters(), local_job.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name
    assert all(p.grad is None for p in job.model.parameters())  # zero_grad(set_to_none)
    assert all(r.gemms_local == GPT_GEMMS and r.tiles == 0 for r in records)


def _mlp_job(batches: int, dropout: float = 0.0) -> Job:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 32), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    model = nn.Sequential(*layers, nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))]
    data *= batches
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Job(model=model, loss_fn=F.cross_entropy, optimizer=opt, batches=data, name="mlp")


def test_training_stops_when_the_batches_run_out(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    records = Trainer(_mlp_job(batches=2), None, metrics_out=metrics).run(5)
    assert [r.step for r in records] == [0, 1]
    assert len(metrics.read_text().splitlines()) == 2


def test_a_run_returns_only_its_latest_step_records(monkeypatch: pytest.MonkeyPatch) -> None:
    # A served run of many steps hands each record to on_step; holding every one of
    # them as well would grow the coordinator's memory with every step.
    monkeypatch.setattr(trainer_module, "KEPT_RECORDS", 2)
    seen: list[StepRecord] = []
    records = Trainer(_mlp_job(batches=5), None).run(5, on_step=seen.append)
    assert [r.step for r in seen] == [0, 1, 2, 3, 4]
    assert records == seen[-2:]


def test_the_heap_is_trimmed_after_each_step_once_its_gradients_are_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job = _mlp_job(batches=3)
    grads_then: list[bool] = []

    def trim(_: StepTrims) -> bool:
        grads_then.append(any(p.grad is not None for p in job.model.parameters()))
        return True

    monkeypatch.setattr(StepTrims, "after_step", trim)
    Trainer(job, None).run(3)
    assert grads_then == [False, False, False]


def test_a_cancelled_step_raises_and_records_nothing(tmp_path: Path) -> None:
    cancel = threading.Event()
    cancel.set()
    metrics = tmp_path / "m.jsonl"
    trainer = Trainer(_mlp_job(batches=3), None, metrics_out=metrics, cancel=cancel)
    with pytest.raises(StepCancelled):
        trainer.run(2)
    assert trainer.step == 0 and trainer.losses == [] and not metrics.exists()


def test_a_dropout_model_matches_local_training() -> None:
    want = train_locally(_mlp_job(batches=3, dropout=0.5), 3)
    got = [r.loss for r in Trainer(_mlp_job(batches=3, dropout=0.5), None).run(3)]
    assert_losses_match(got, want)


class _TransposedDropout(nn.Module):
    """Dropout on a transposed activation, as ``nn.MultiheadAttention`` with
    ``batch_first`` hands its output to the dropout after it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x.transpose(0, 1)).transpose(0, 1)  # (batch, seq, 16), seq-major
        if self.kind == "alpha":
            h = F.alpha_dropout(h, 0.3, self.training)
        elif self.kind == "bernoulli_":  # a dropout of the job's own
            h = h * torch.empty_like(h).bernoulli_(0.7) / 0.7
        elif self.kind == "inplace":
            h = F.dropout(h + 1, 0.3, self.training, inplace=True)
        else:
            h = torch.dropout(h, 0.3, self.training)
        return self.head(h).mean(1)


def _transposed_dropout_job(kind: str) -> Job:
    torch.manual_seed(0)
    if kind == "transformer":
        model: nn.Module = nn.Sequential(
            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True),
            nn.Flatten(),
            nn.Linear(16 * 6, 4),
        )
    else:
        model = _TransposedDropout(kind)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, 16, generator=g), torch.randint(0, 4, (8,), generator=g))]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Job(model=model, loss_fn=F.cross_entropy, optimizer=opt, batches=data * 3)


@pytest.mark.parametrize("kind", ["transformer", "alpha", "inplace", "torch.dropout", "bernoulli_"])
def test_dropout_on_a_transposed_activation_draws_local_torchs_masks(kind: str) -> None:
    # A trace draws dropout's noise out of place into a contiguous tensor; eager draws it
    # into one laid out like the input, which on most CPUs puts the mask elsewhere.
    want = train_locally(_transposed_dropout_job(kind), 3)
    got = [r.loss for r in Trainer(_transposed_dropout_job(kind), None).run(3)]
    assert_losses_match(got, want, rel=1e-6)  # another mask moves them by 1e-4 and more


class KeptHereOffload:
    """Every GEMM multiplied at once on the training thread, as the planner's own share
    of a GEMM is (timed as the ``kept_tiles`` stage)."""

    def start(self, name: str, op: str, a: torch.Tensor, b: torch.Tensor, done: GemmDone) -> int:
        with COSTS.timed("kept_tiles"):
            c = torch.matmul(a, b)
        done(c)
        return 1


def test_the_tiles_the_coordinator_multiplies_itself_are_not_orchestration() -> None:
    records = Trainer(make_job(seed=0), KeptHereOffload()).run(2)
    for record in records:
        assert record.cpu is not None
        kept = record.cpu["kept_tiles"]
        assert kept > 0
        assert record.orchestration_cpu_s == pytest.approx(record.process_cpu_s - kept, abs=2e-4)


@pytest.mark.parametrize(
    "loss_fn, error, says",
    [
        (lambda out, y: F.cross_entropy(out, y, reduction="none"), ValueError, "shape [8]"),
        (lambda out, y: F.cross_entropy(out, y).item(), TypeError, "not a Python number"),
    ],
)
def test_a_loss_that_is_not_one_number_says_what_to_change(
    loss_fn: object, error: type[Exception], says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Forgetting the batch reduction is the common mistake: local training and the
    trainer name the loss function and the fix, not torch's words about implicit grads,
    and the trainer says it once: not first that the step cannot be captured and will
    run eagerly, where the same mistake stops it."""
    for run in (lambda job: train_locally(job, 1), lambda job: Trainer(job, None).run(1)):
        job = _mlp_job(batches=1)
        job.loss_fn = loss_fn  # type: ignore[assignment]
        with pytest.raises(error, match="Job.loss_fn must return") as raised:
            run(job)
        assert says in str(raised.value)
    assert "cannot be captured" not in caplog.text


def _with_update(batches: int = 1, **fields: Any) -> Job:
    job = _mlp_job(batches=batches)
    return Job(job.model, job.loss_fn, job.optimizer, job.batches, **fields)


def test_a_schedule_or_clipping_the_step_cannot_take_is_refused_with_the_reason() -> None:
    job = _mlp_job(batches=1)
    other = torch.optim.SGD(job.model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="another optimizer"):
        _with_update(lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 10))
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        _with_update(lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(job.optimizer))
    with pytest.raises(TypeError, match="LRScheduler"):
        _with_update(lr_scheduler=lambda step: 0.1)
    for clip in (0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="clip_grad_norm"):
            _with_update(clip_grad_norm=clip)
    with pytest.raises(ValueError, match=r"LBFGS\) needs a closure"):
        Job(job.model, job.loss_fn, torch.optim.LBFGS(job.model.parameters()), job.batches)


def test_clipping_scales_the_gradients_the_trainer_computed() -> None:
    # The traced step's gradients, computed through an offload, are clipped as local
    # torch's are; and the clipping changes the trajectory, so it is not skipped.
    want = train_locally(_with_update(3, clip_grad_norm=0.01), 3)
    unclipped = train_locally(_with_update(3), 3)
    assert abs(want[2] - unclipped[2]) > 1e-4, (want, unclipped)
    trainer = Trainer(_with_update(3, clip_grad_norm=0.01), InThreadOffload())
    assert_losses_match([r.loss for r in trainer.run(3)], want, rel=1e-6)


class _KeywordLM(nn.Module):
    """A model called as Hugging Face models are: ``model(**batch)``, returning its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        logits = self.head(h)
        assert labels is not None
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)}


class _DictLM(_KeywordLM):
    """A model whose forward takes the batch's dict as its one argument."""

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return super().forward(**batch)


@pytest.mark.parametrize("model_type", [_KeywordLM, _DictLM])
def test_a_dict_of_inputs_goes_in_as_keywords_where_the_forward_takes_them(
    model_type: type[nn.Module],
) -> None:
    def make() -> Job:
        torch.manual_seed(0)
        model = model_type()
        g = torch.Generator().manual_seed(1)
        data = []
        for _ in range(3):
            ids = torch.randint(0, 32, (4, 8), generator=g)
            mask = torch.ones_like(ids)
            mask[0, 6:] = 0
            labels = ids.masked_fill(mask == 0, -100)
            batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
            data.append((batch, labels))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        return Job(model, lambda out, _: out["loss"], opt, data)

    want = train_locally(make(), 3)
    trainer = Trainer(make(), InThreadOffload())
    assert_losses_match([r.loss for r in trainer.run(3)], want, rel=1e-6)
    assert trainer.tracer.get(*make().next_batch()) is not None  # captured, not eager


class _WeightedLM(_KeywordLM):
    """Takes a per-example weight that is not a tensor: a numpy array."""

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, labels: torch.Tensor, weights: np.ndarray
    ) -> dict[str, torch.Tensor]:
        logits = self.head(self.embed(input_ids))
        losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(1)
        return {"loss": (losses * torch.from_numpy(weights)).mean()}


@pytest.mark.parametrize("batch_type", ["UserDict", "numpy"])
def test_batches_of_mappings_that_are_not_dicts_or_of_arrays_train_as_locally(
    batch_type: str,
) -> None:
    """A tokenizer's BatchEncoding is a mapping, not a dict: torch's pytree does not see
    into it. A numpy array in a batch cannot be traced (one graph would keep its first
    value): such steps run eagerly and say why."""

    def make() -> Job:
        torch.manual_seed(0)
        model = _WeightedLM() if batch_type == "numpy" else _KeywordLM()
        g = torch.Generator().manual_seed(1)
        data = []
        for step in range(3):
            ids = torch.randint(0, 32, (4, 8), generator=g)
            batch: dict[str, Any] = {"input_ids": ids, "labels": ids}
            if batch_type == "numpy":
                batch["weights"] = np.linspace(0.5, 1.5, 4, dtype=np.float32) * (step + 1)
            data.append((UserDict(batch), ids))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        return Job(model, lambda out, _: out["loss"], opt, data)

    want = train_locally(make(), 3)
    trainer = Trainer(make(), InThreadOffload())
    assert_losses_match([r.loss for r in trainer.run(3)], want, rel=1e-6)
    captured = trainer.tracer.get(*make().next_batch())
    if batch_type == "numpy":
        assert captured is None
        (failure,) = trainer.tracer.failures.values()
        assert "holds a ndarray, which is not a tensor" in failure.reason
    else:
        assert captured is not None


@pytest.mark.parametrize(
    "batch, says",
    [
        ({"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2, 4)}, "mapping with keys"),
        ((torch.zeros(2, 16), torch.zeros(2), torch.zeros(2)), "tuple of 3"),
        (torch.zeros(2, 16), "Tensor"),
    ],
)
def test_batches_that_are_not_pairs_are_refused_with_what_to_yield(batch: Any, says: str) -> None:
    # A data loader of dicts, as Hugging Face's yield, unpacked as (inputs, targets) took
    # two of its keys, or failed with "too many values to unpack".
    for run in (lambda job: train_locally(job, 1), lambda job: Trainer(job, None).run(1)):
        job = _mlp_job(batches=1)
        job.batches = [batch]
        with pytest.raises(ValueError, match="Job.batches must yield") as raised:
            run(job)
        assert says in str(raised.value)


class _TwoHeads(nn.Module):
    """A multi-task model: each batch says which head it trains; the other is unused."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.heads = nn.ModuleList([nn.Linear(32, 4), nn.Linear(32, 4)])
        self.unused = nn.Linear(32, 4)  # an evaluation head, never in the training step

    def forward(self, batch: tuple[torch.Tensor, int]) -> torch.Tensor:
        x, task = batch
        return self.heads[task](torch.relu(self.body(x)))


def test_a_parameter_the_step_does_not_use_is_left_alone_as_locally() -> None:
    # Local torch leaves an unused parameter's grad None and the optimizer skips it; a
    # zero gradient instead would move it by momentum and weight decay.
    def make() -> Job:
        torch.manual_seed(0)
        model = _TwoHeads()
        g = torch.Generator().manual_seed(1)
        data = [
            ((torch.randn(8, 16, generator=g), step % 2), torch.randint(0, 4, (8,), generator=g))
            for step in range(6)
        ]
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        return Job(model, F.cross_entropy, opt, data)

    local = make()
    want = train_locally(local, 6)
    trainer = Trainer(make(), InThreadOffload())
    assert_losses_match([r.loss for r in trainer.run(6)], want, rel=1e-6)
    for name, value in local.model.state_dict().items():
        torch.testing.assert_close(trainer.job.model.state_dict()[name], value, msg=name)
    assert trainer.job.model.unused.weight not in trainer.job.optimizer.state


def test_frozen_parameters_take_no_gradient_and_no_gemm_until_unfrozen() -> None:
    # Fine-tuning freezes layers with requires_grad_(False) and often still hands every
    # parameter to the optimizer: local torch leaves the frozen ones alone and computes
    # no gradient for them. Here the first layer thaws after three steps.
    def make() -> Job:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        model[0].requires_grad_(False)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))] * 6

        def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for step, batch in enumerate(data):
                if step == 3:
                    model[0].requires_grad_(True)
                yield batch

        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        return Job(model, F.cross_entropy, opt, batches())

    local = make()
    want = train_locally(local, 6)
    offload = RecordingOffload()
    trainer = Trainer(make(), offload)
    records = trainer.run(6)
    assert_losses_match([r.loss for r in records], want, rel=1e-6)
    for name, value in local.model.state_dict().items():
        torch.testing.assert_close(trainer.job.model.state_dict()[name], value, msg=name)
    # Frozen: 2 forward GEMMs and the last layer's weight gradient; thawed: the first
    # layer's weight gradient and the input gradient it needs too.
    assert [r.gemms_offloaded for r in records] == [3, 3, 3, 5, 5, 5]


def _scale_the_gradient(p: torch.Tensor) -> None:
    assert p.grad is not None
    p.grad.mul_(0.1)


def test_the_offload_tells_a_traced_steps_gemms_from_an_eager_steps() -> None:
    # What may take an earlier cut's block id (coordinator.tiles.step_blocks) depends on
    # it: Python runs between an eager step's GEMMs.
    names = {}
    for kind in ("traced", "eager"):
        job = _mlp_job(batches=2)
        if kind == "eager":  # a parameter's own hook makes its step run eagerly
            next(job.model.parameters()).register_hook(lambda g: g)
        offload = RecordingOffload()
        Trainer(job, offload).run(2)
        names[kind] = [name for name, _, _ in offload.calls]
    assert names["traced"] and all(traced(name) for name in names["traced"])
    assert names["eager"] and not any(traced(name) for name in names["eager"])


@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_gradient_hooks_on_parameters_run_as_locally(hook: str) -> None:
    # A traced step computes gradients apart from the parameters, so their own hooks
    # would not run: such a step runs eagerly, where they do.
    def make() -> Job:
        job = _mlp_job(batches=3)
        for p in job.model.parameters():
            if hook == "register_hook":
                p.register_hook(lambda g: g.clamp(-0.01, 0.01))
            else:
                p.register_post_accumulate_grad_hook(_scale_the_gradient)
        return job

    want = train_locally(make(), 3)
    trainer = Trainer(make(), InThreadOffload())
    assert_losses_match([r.loss for r in trainer.run(3)], want, rel=1e-6)
    (failure,) = trainer.tracer.failures.values()
    assert "has a gradient hook" in failure.reason


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("hook", ["forward", "forward pre", "full backward", "pruning"])
def test_module_hooks_run_at_each_step_as_locally(hook: str) -> None:
    # A hook that records what it sees would run once, during the trace, with its
    # placeholder tensors: the step runs eagerly instead. torch's pruning recomputes
    # the weight in a forward pre-hook, tensor work only: that step is still one graph.
    def make() -> tuple[Job, list[torch.Tensor]]:
        job = _mlp_job(batches=4)
        seen: list[torch.Tensor] = []
        layer = job.model[0]
        if hook == "forward":
            layer.register_forward_hook(lambda m, i, out: seen.append(out.detach()))
        elif hook == "forward pre":
            layer.register_forward_pre_hook(lambda m, i: seen.append(i[0].detach()))
        elif hook == "full backward":
            layer.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].detach()))
        else:
            prune.l1_unstructured(layer, "weight", amount=0.5)
        return job, seen

    local, seen_locally = make()
    want = train_locally(local, 4)
    job, seen = make()
    trainer = Trainer(job, InThreadOffload())
    assert_losses_match([r.loss for r in trainer.run(4)], want, rel=1e-6)
    assert len(seen) == len(seen_locally)
    for got, expected in zip(seen, seen_locally, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if hook == "pruning":
        assert not trainer.tracer.failures
        assert trainer.tracer.get(*make()[0].next_batch()) is not None
    else:
        (failure,) = trainer.tracer.failures.values()
        kind = {"forward": "forward hook", "forward pre": "forward pre-hook"}
        assert f"module 0 has a {kind.get(hook, 'backward hook')}" in failure.reason


def test_a_step_is_captured_again_once_its_hooks_are_removed() -> None:
    job = _mlp_job(batches=4)
    handle = job.model[0].register_forward_hook(lambda m, i, out: None)
    trainer = Trainer(job, InThreadOffload())
    trainer.run(2)
    assert trainer.tracer.get(*job.next_batch()) is None
    handle.remove()
    assert trainer.tracer.get(*job.next_batch()) is not None


class _Spectral(nn.Module):
    """A Fourier neural operator's spectral layer: complex weights multiplied with the
    input's lowest Fourier modes (complex bmm), then a complex linear map (complex mm).
    ``branchy`` reads a value in Python, so the step runs eagerly."""

    def __init__(self, branchy: bool) -> None:
        super().__init__()
        self.lift = nn.Linear(2, 8)
        self.modes = nn.Parameter(torch.randn(6, 8, 8, dtype=torch.cfloat) / 8)
        self.mix = nn.Parameter(torch.randn(8, 8, dtype=torch.cfloat) / 8)
        self.head = nn.Linear(8, 1)
        self.branchy = branchy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x)  # (batch, points, 8)
        f = torch.fft.rfft(h, dim=1)  # (batch, modes, 8)
        low = torch.einsum("bmi,mio->bmo", f[:, :6], self.modes) @ self.mix
        f = torch.cat((low, torch.zeros_like(f[:, 6:])), dim=1)
        h = h + torch.fft.irfft(f, n=x.shape[1], dim=1)
        if self.branchy and bool(h.sum() > 1e9):
            h = h * 0
        return self.head(torch.tanh(h)).squeeze(-1)


@pytest.mark.parametrize("branchy", [False, True])
def test_complex_gemms_go_to_workers_as_real_ones(branchy: bool) -> None:
    def make() -> Job:
        torch.manual_seed(0)
        model = _Spectral(branchy)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 32, 2, generator=g), torch.randn(4, 32, generator=g))]
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return Job(model, F.mse_loss, opt, data * 4)

    want = train_locally(make(), 4)
    offload = RecordingOffload()
    trainer = Trainer(make(), offload)
    assert_losses_match([r.loss for r in trainer.run(4)], want, rel=1e-5)
    assert (trainer.tracer.get(*make().next_batch()) is None) == branchy
    # Workers multiply real dtypes only; every GEMM of the step went to them.
    assert {dtype for _, _, dtype in offload.calls} == {torch.float32}
    assert trainer.flops["workers_share"] == 1.0


class _GraphConvolution(nn.Module):
    """A graph network as written without a library: a sparse adjacency matrix the model
    holds, multiplied with dense features (torch.sparse.mm). ``branchy`` reads a value in
    Python, so the step runs eagerly."""

    def __init__(self, branchy: bool) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        edges = torch.randint(0, 40, (2, 160), generator=gen)
        weights = torch.rand(160, generator=gen)
        adjacency = torch.sparse_coo_tensor(edges, weights, (40, 40), check_invariants=True)
        self.adjacency = adjacency.coalesce()
        self.inner = nn.Linear(8, 16)
        self.out = nn.Linear(16, 3)
        self.branchy = branchy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.sparse.mm(self.adjacency, self.inner(x)))
        if self.branchy and bool(h.sum() > 1e9):
            h = h * 0
        return torch.sparse.mm(self.adjacency, self.out(h))


@pytest.mark.parametrize("branchy", [False, True])
def test_a_sparse_operand_runs_here_and_the_dense_gemms_go_to_workers(branchy: bool) -> None:
    def make() -> Job:
        torch.manual_seed(0)
        model = _GraphConvolution(branchy)
        g = torch.Generator().manual_seed(1)
        nodes, labels = torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return Job(model, F.cross_entropy, opt, [(nodes, labels)] * 4)

    want = train_locally(make(), 4)
    offload = _DenseOnly()
    trainer = Trainer(make(), offload)
    assert_losses_match([r.loss for r in trainer.run(4)], want, rel=1e-6)
    assert (trainer.tracer.get(*make().next_batch()) is None) == branchy
    # The linear layers' GEMMs went out (forward, and weight and input gradients).
    assert len(offload.calls) >= 4 * 4


class _DenseOnly(RecordingOffload):
    """Tiles carry dense blocks: a sparse operand must never reach an offload."""

    def start(self, name: str, op: str, a: torch.Tensor, b: torch.Tensor, *args: Any) -> int:
        assert a.layout == b.layout == torch.strided, (name, a.layout, b.layout)
        return super().start(name, op, a, b, *args)


def _dice_job(bad_label_at: int | None = None) -> Job:
    """A segmentation-style loss as people write it: a soft Dice loss over one-hot
    targets (F.one_hot with the number of classes)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(4)
    ]
    if bad_label_at is not None:
        data[bad_label_at][1][3] = 7

    def dice(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        probs, target = logits.softmax(-1), F.one_hot(labels, 4).float()
        overlap = (probs * target).sum(0)
        return 1 - (2 * overlap / (probs.sum(0) + target.sum(0) + 1e-6)).mean()

    return Job(model, dice, torch.optim.SGD(model.parameters(), lr=0.5), data)


def test_one_hot_with_a_number_of_classes_is_captured() -> None:
    want = train_locally(_dice_job(), 4)
    trainer = Trainer(_dice_job(), InThreadOffload())
    assert_losses_match([r.loss for r in trainer.run(4)], want, rel=1e-6)
    assert not trainer.tracer.failures
    # A class index out of range fails at the step that holds it, as in local torch.
    with pytest.raises(RuntimeError, match="smaller than num_classes"):
        train_locally(_dice_job(bad_label_at=2), 4)
    trainer = Trainer(_dice_job(bad_label_at=2), InThreadOffload())
    with pytest.raises(RuntimeError, match="smaller than num_classes"):
        trainer.run(4)
    assert trainer.step == 2  # the two steps before it completed


class _VariationalAutoencoder(nn.Module):
    def __init__(self, validate: bool) -> None:
        super().__init__()
        self.encode, self.decode = nn.Linear(16, 8), nn.Linear(4, 16)
        self.validate = validate

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_var = self.encode(x).chunk(2, dim=1)
        posterior = torch.distributions.Normal(
            mu, (0.5 * log_var).exp(), validate_args=self.validate
        )
        prior = torch.distributions.Normal(
            torch.zeros_like(mu), torch.ones_like(mu), validate_args=self.validate
        )
        kl = torch.distributions.kl_divergence(posterior, prior).sum(1).mean()
        return self.decode(posterior.rsample()), kl


@pytest.mark.parametrize("validate", [True, False])
def test_torch_distributions_say_how_to_be_captured(validate: bool) -> None:
    def make() -> Job:
        torch.manual_seed(0)
        model = _VariationalAutoencoder(validate)
        g = torch.Generator().manual_seed(1)
        data = [(x, x) for x in torch.randn(4, 8, 16, generator=g)]

        def loss(out: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(out[0], x) + 0.1 * out[1]

        return Job(model, loss, torch.optim.Adam(model.parameters(), lr=1e-2), data)

    want = train_locally(make(), 4)
    trainer = Trainer(make(), InThreadOffload())
    assert_losses_match([r.loss for r in trainer.run(4)], want, rel=1e-6)
    if validate:
        (failure,) = trainer.tracer.failures.values()
        assert "validate_args=False" in failure.reason
    else:
        assert not trainer.tracer.failures


class _PythonDecides(nn.Module):
    """Layer drop decided with Python's random module, or a scale that a Python counter
    changes after the first step: decisions a trace would keep from the traced step."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.calls = 0
        self.rng = random.Random(3)  # seeded with the job, as torch's generator is
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        for layer in self.layers:
            if self.kind == "layer drop" and self.training and self.rng.random() < 0.5:
                continue
            x = x + torch.tanh(layer(x))
        scale = 1.0 if self.kind != "counter" or self.calls < 2 else 0.5
        return self.head(x) * scale


@pytest.mark.parametrize("kind", ["layer drop", "counter"])
def test_python_that_decides_differently_at_later_steps_runs_them_as_locally(kind: str) -> None:
    def make() -> Job:
        torch.manual_seed(0)
        return repeated_batch_job(_PythonDecides(kind), rows=8, features=16, steps=6)

    want = train_locally(make(), 6)
    trainer = Trainer(make(), InThreadOffload())
    assert_losses_match([r.loss for r in trainer.run(6)], want, rel=1e-6)
    # The model's Python ran once a step, as locally: traced twice, then eagerly.
    assert isinstance(trainer.job.model, _PythonDecides) and trainer.job.model.calls == 6
    (failure,) = trainer.tracer.failures.values()
    assert "other decisions at the next step" in failure.reason


class _MaskedAttentionLM(nn.Module):
    """Attention whose mask is built as transformers builds it: outside graph capture it
    may ask in Python whether any token is padding (a question one graph cannot hold) and
    then use SDPA's own causal mask; under capture it builds the mask from the padding
    mask. The own path can be made one a graph holds; the capture path one it cannot
    hold, or one that rounds otherwise (as some libraries' compile paths do)."""

    def __init__(self, own_path_traceable: bool, compile_path: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 32)
        self.own_path_traceable = own_path_traceable
        self.compile_path = compile_path

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        q, k, v = self.qkv(h).unsqueeze(1).chunk(3, dim=-1)
        compiling = torch.compiler.is_compiling()
        if compiling and self.compile_path == "untraceable":
            h = h + h[attention_mask.bool()].sum() * 0  # a shape taken from data
        if compiling and self.compile_path == "rounds":
            q = q.bfloat16().float()
        if not compiling and not self.own_path_traceable and bool(attention_mask.all()):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            n = input_ids.shape[1]
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            mask = causal & attention_mask.bool()[:, None, None, :]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        logits = self.head(h + a.squeeze(1))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)}


@pytest.mark.parametrize(
    ("own_path", "compile_path"),
    [(False, "exact"), (True, "untraceable"), (True, "rounds"), (False, "untraceable")],
)
def test_a_model_that_reads_its_padding_mask_outside_graph_capture_is_captured(
    own_path: bool, compile_path: str
) -> None:
    def make() -> Job:
        torch.manual_seed(0)
        model = _MaskedAttentionLM(own_path, compile_path)
        g = torch.Generator().manual_seed(1)
        data = []
        for step in range(4):
            ids = torch.randint(0, 32, (4, 8), generator=g)
            mask = torch.ones_like(ids)
            if step % 2:
                mask[1, 5:] = 0  # right padding in one row, every other batch
            labels = ids.masked_fill(mask == 0, -100)
            data.append(({"input_ids": ids, "attention_mask": mask, "labels": labels}, labels))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return Job(model, lambda out, _: out["loss"], opt, data)

    want = train_locally(make(), 4)
    trainer = Trainer(make(), InThreadOffload())
    assert_losses_match([r.loss for r in trainer.run(4)], want, rel=1e-6)
    if own_path or compile_path != "untraceable":
        # The step is one graph, whichever batches have padding; the model's own path
        # where it can be one, as it computes what local torch computes.
        assert trainer.tracer.get(*make().next_batch()) is not None
        assert not trainer.tracer.failures
    else:
        # The step runs eagerly, and says why in the words of the model's own path, the
        # one local torch runs.
        (failure,) = trainer.tracer.failures.values()
        assert "reads a tensor's value in Python" in failure.reason
    assert not torch.compiler.is_compiling()
