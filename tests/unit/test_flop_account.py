"""The workers' share of a step's FLOPs, against a count made without Cleave's formulas.

For every model in ``real_models`` one step runs through the trainer with an offload that
computes each GEMM at once and notes its size; independently, the same step runs as plain
torch under ``torch.utils.flop_counter.FlopCounterMode``, with the formulas torch lacks
or overstates written here from their definitions: a grouped GEMM reads its offsets; a
convolution's backward costs the forward once per gradient it returns; CPU flash
attention is two products forward and five backward (the fused kernel recomputes the
scores from the saved log-sum-exp, and so does Cleave's lowering: that product is real
work, done by workers). The share the trainer reports must match (offloaded FLOPs) /
(the independent total) within 1%.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support import real_models
from support.recording_offload import RecordingOffload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from coordinator.step.flops import (
    FlopTally,
    describe,
    mostly_kept,
    op_flops,
    op_name,
    uncounted,
)
from coordinator.step.job import Job
from coordinator.step.trainer import Trainer

pytestmark = pytest.mark.timeout(120)
aten = torch.ops.aten

MODELS: dict[str, Callable[[], Job]] = {
    "sdpa transformer": lambda: real_models.make_sdpa_job(seq=64, batch=2),
    "cnn, grouped": lambda: real_models.make_cnn_job(batch=4, size=16, groups=2),
    "padded transformer": real_models.make_data_dependent_job,
    "moe, grouped GEMMs": real_models.make_moe_job,
    "moe, expert loop": real_models.make_moe_loop_job,
    "resnext": real_models.make_resnext_job,
    "convnext": real_models.make_convnext_job,
}


def _grouped_mm(a: Any, b: Any, offs: Any = None, *args: Any, **kwargs: Any) -> int:
    if offs is None:  # (G, M, K) x (G, K, N)
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    ends = [0, *offs.tolist()]
    sizes = [e - s for s, e in zip(ends, ends[1:], strict=False)]
    if a.dim() == 2 and b.dim() == 3:  # rows of a by group
        return sum(2 * n * a.shape[1] * b.shape[2] for n in sizes)
    if a.dim() == 2 and b.dim() == 2:  # the shared dimension by group
        return sum(2 * a.shape[0] * n * b.shape[1] for n in sizes)
    return sum(2 * a.shape[1] * a.shape[2] * n for n in sizes)  # columns of b by group


def _conv_backward(grad_out: Any, x: Any, w: Any, *args: Any, **kwargs: Any) -> int:
    # args: bias sizes, stride, padding, dilation, transposed, output padding, groups, mask.
    # The weight's shape holds C/groups already: the forward's count is exact when grouped.
    transposed, mask = args[4], args[7]
    forward = conv_flop_count(list(x.shape), list(w.shape), list(grad_out.shape), transposed)
    return forward * (int(mask[0]) + int(mask[1]))


def _products(q: Any, k: Any, v: Any) -> int:
    """FLOPs of one of attention's products: scores ``q kᵀ`` (or ``p v``, the same size)."""
    assert q.shape[-1] == v.shape[-1]
    return 2 * q.shape[:-1].numel() * k.shape[-2] * q.shape[-1]


def _flash(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    return 2 * _products(q, k, v)


def _flash_backward(grad: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    return 5 * _products(q, k, v)  # scores again, then dv, dp, dq, dk


def _torch_count(job: Job) -> int:
    x, y = job.next_batch()
    for formula in (_grouped_mm, _conv_backward, _flash, _flash_backward):
        formula._get_raw = True  # type: ignore[attr-defined]  # tensors, not shapes: offsets
    mapping = {
        aten._grouped_mm: _grouped_mm,
        aten.convolution_backward: _conv_backward,
        aten._scaled_dot_product_flash_attention_for_cpu: _flash,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_backward,
    }
    with FlopCounterMode(display=False, custom_mapping=mapping) as c:
        with job.autocast_context():
            loss = job.loss_fn(job.model(x), y)
        loss.backward()
    return int(c.get_total_flops())


@pytest.mark.parametrize("name", list(MODELS))
def test_reported_share_matches_an_independent_count(name: str) -> None:
    make = MODELS[name]
    offload = RecordingOffload()
    trainer = Trainer(make(), offload)
    trainer.run(1)
    total = _torch_count(make())
    share = trainer.flops["workers_share"]
    assert trainer.flops["uncounted"] == []
    assert share == pytest.approx(offload.flops / total, abs=0.01), (name, trainer.flops, total)
    assert trainer.flops["gflop"] * 1e9 == pytest.approx(total, rel=0.01), (name, total)


def test_a_grouped_convolutions_backward_counts_its_weight_gradient_once() -> None:
    x, w = torch.randn(2, 64, 8, 8), torch.randn(64, 1, 7, 7)  # depthwise
    out = torch.nn.functional.conv2d(x, w, padding=3, groups=64)
    args = (out, x, w, None, [1, 1], [3, 3], [1, 1], False, [0, 0], 64, [True, True, False])
    forward = 2 * 2 * 64 * 8 * 8 * 49  # one multiply-add per output element and tap
    assert op_flops(aten.convolution_backward.default, args, {}, None) == 2 * forward


def test_a_heavy_op_without_a_formula_is_named_and_the_share_is_a_bound() -> None:
    class Spectral(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.fft.rfft(x, dim=-1).abs()[..., :64])

    torch.manual_seed(0)
    model = Spectral()
    job = Job(
        model=model,
        loss_fn=lambda out, y: (out - y).square().mean(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        batches=iter([(torch.randn(256, 128), torch.randn(256, 64))] * 3),
        name="spectral",
    )
    trainer = Trainer(job, RecordingOffload())
    trainer.run(1)
    assert trainer.flops["uncounted"] == ["_fft_r2c"], trainer.flops
    text = describe(trainer.flops)
    assert "workers computed at most 100.0%" in text and "_fft_r2c" in text, text


def test_only_heavy_ops_without_a_formula_are_uncounted() -> None:
    for op in (aten._fft_r2c.default, aten.linalg_solve_ex.default, aten._int_mm.default):
        assert uncounted(op), op
    for op in (aten.mm.default, aten._grouped_mm.default, aten.relu.default, aten.sum.default):
        assert not uncounted(op), op
    for op in (aten.addcmul.default, aten.mean.default, aten.native_layer_norm.default):
        assert not uncounted(op), op
    tally = FlopTally(workers=10)
    tally.ran_here(aten.relu.default, 0)
    tally.ran_here(aten._fft_r2c.default, 0)
    assert tally.summary()["uncounted"] == ["_fft_r2c"]


def test_an_lstm_fused_by_onednn_is_counted_as_kept_here_with_what_to_change() -> None:
    """nn.LSTM on a CPU runs each layer's forward as one fused oneDNN op: its GEMMs stay
    here. They are counted from the layer's definition (four gates, input and hidden
    projections at every position), and the reason says how to hand them out. The traced
    step's backward is decomposed into plain GEMMs, which go to workers: the forward's
    products again (the gates are recomputed), then the gradients, twice as many."""
    batch, seq, vocab, emb, hidden = 4, 12, 50, 32, 64

    class LanguageModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, emb)
            self.rnn = torch.nn.LSTM(emb, hidden, num_layers=2, batch_first=True)
            self.head = torch.nn.Linear(hidden, vocab)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(self.emb(x))[0]).flatten(0, 1)

    torch.manual_seed(0)
    model = LanguageModel()
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    job = Job(
        model=model,
        loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y.flatten()),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        batches=iter([(tokens[:, :-1], tokens[:, 1:])] * 2),
        name="lstm",
    )
    offload = RecordingOffload()
    trainer = Trainer(job, offload)
    trainer.run(1)
    positions = batch * seq
    gates = 4 * hidden
    rnn = sum(2 * positions * gates * (inputs + hidden) for inputs in (emb, hidden))
    head = 2 * positions * hidden * vocab
    offloaded = 3 * rnn + 3 * head  # the backward's recomputed gates and gradients, the head
    assert trainer.flops["uncounted"] == [], trainer.flops
    assert trainer.flops["gflop"] * 1e9 == pytest.approx(rnn + offloaded, rel=0.01), trainer.flops
    assert offload.flops == pytest.approx(offloaded, rel=0.01)
    assert trainer.flops["workers_share"] == pytest.approx(offloaded / (rnn + offloaded), abs=0.01)
    (row,) = trainer.flops["kept_here"]
    assert row["op"] == "mkldnn_rnn_layer" and row["gflop"] == pytest.approx(rnn / 1e9, rel=0.01)
    assert "mkldnn.flags(enabled=False)" in row["why"], row


def test_an_eager_lstms_fused_backward_counts_twice_its_forward() -> None:
    """Run eagerly (``Pool.offload``), the LSTM's backward is one fused op too."""
    seen: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            if "mkldnn_rnn_layer" in str(func):
                seen[op_name(func)] = op_flops(func, args, kwargs or {}, out)
            return out

    rnn = torch.nn.LSTM(8, 16, batch_first=True)
    with Count():
        rnn(torch.randn(3, 5, 8, requires_grad=True))[0].sum().backward()
    forward = 2 * 3 * 5 * (4 * 16) * (8 + 16)
    assert seen == {"mkldnn_rnn_layer": forward, "mkldnn_rnn_layer_backward": 2 * forward}


def test_products_with_a_vector_are_counted_and_a_vector_norm_is_not_heavy() -> None:
    a, x = torch.randn(6, 5), torch.randn(5)
    assert op_flops(aten.mv.default, (a, x), {}, a @ x) == 2 * 6 * 5
    assert op_flops(aten.addmv.default, (torch.randn(6), a, x), {}, None) == 2 * 6 * 5
    assert op_flops(aten.vdot.default, (x, x), {}, None) == 2 * 5
    assert not uncounted(aten.linalg_vector_norm.default)
    assert uncounted(aten.linalg_matrix_exp.default)  # other linalg ops still are


def test_the_op_keeping_most_of_a_step_here_is_named_only_below_half() -> None:
    tally = FlopTally(workers=40)
    tally.keep("mkldnn_rnn_layer", 50)
    tally.keep("mm", 10)
    assert mostly_kept(tally) == "mkldnn_rnn_layer"  # workers computed 40%
    tally.workers = 60
    assert mostly_kept(tally) is None  # half of it: the pool carries the step
    assert mostly_kept(FlopTally()) is None  # nothing counted
    assert mostly_kept(FlopTally(workers=0, kept={"bmm": 5})) == "bmm"
