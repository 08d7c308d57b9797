"""``torch._grouped_mm`` split into its groups' products: every form torch defines, empty
groups, bf16, and the executor sending the groups of a captured step's grouped GEMMs out
while keeping the ones its offload does not take."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.real_models import make_moe_job
from support.recording_offload import RecordingOffload

from common.ops import TileOp
from common.unfold import Unfold
from coordinator.step.executor import DataflowExecutor, GemmDone
from coordinator.step.grouped_mm import grouped_mm_flops, split_grouped_mm, start_pieces
from coordinator.step.job import train_locally
from coordinator.step.tracing import trace_step
from coordinator.step.trainer import Trainer

pytestmark = pytest.mark.timeout(120)


def _offs(*ends: int) -> torch.Tensor:
    return torch.tensor(ends, dtype=torch.int32)


def _forms(dtype: torch.dtype) -> list[tuple[str, torch.Tensor, torch.Tensor, Any]]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return [
        ("2d x 3d", r(20, 16), r(4, 16, 8), _offs(5, 5, 12, 20)),
        ("2d x 3d, rows past the last group", r(20, 16), r(4, 16, 8), _offs(3, 9, 9, 14)),
        ("3d x 3d", r(4, 6, 16), r(4, 16, 8), None),
        ("2d x 2d", r(8, 24), r(24, 16), _offs(0, 8, 20, 24)),
        ("2d x 2d, transposed view", r(24, 8).t(), r(24, 16), _offs(4, 4, 16, 24)),
        ("3d x 2d", r(4, 6, 16), r(16, 24), _offs(8, 8, 16, 24)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_form_equals_torchs_grouped_mm(dtype: torch.dtype) -> None:
    for name, a, b, offs in _forms(dtype):
        want = torch._grouped_mm(a, b, offs=offs)
        call = split_grouped_mm(a, b, offs)
        assert call is not None, name
        start_pieces(call, None, name, call.put)
        assert call.left == 0
        if name.endswith("past the last group"):
            want[14:] = 0  # torch leaves these rows unwritten; they are zero here
            assert call.out[14:].eq(0).all()
        torch.testing.assert_close(call.out, want, rtol=0, atol=0, msg=name)
        assert call.flops == grouped_mm_flops(a, b, offs), name


def test_empty_groups_send_nothing_and_shapes_alone_give_a_bound() -> None:
    a, b = torch.randn(20, 16), torch.randn(4, 16, 8)
    call = split_grouped_mm(a, b, _offs(0, 10, 10, 10))
    assert call is not None and [p.group for p in call.pieces] == [1]
    assert grouped_mm_flops(a, b, _offs(0, 10, 10, 10)) == 2 * 10 * 16 * 8
    fake_offs = torch.empty(4, dtype=torch.int32, device="meta")
    assert grouped_mm_flops(a, b, fake_offs) == 2 * 20 * 16 * 8  # every row counted


def test_calls_it_does_not_split_run_as_they_are() -> None:
    a, b = torch.randn(20, 16), torch.randn(4, 16, 8)
    assert split_grouped_mm(a, b, _offs(5, 10, 15, 20), bias=torch.randn(4, 8)) is None
    assert split_grouped_mm(a, b, _offs(5, 10, 15, 20), out_dtype=torch.bfloat16) is None
    assert split_grouped_mm(a, b, _offs(5, 3, 15, 20)) is None  # not ascending
    assert split_grouped_mm(a, b, _offs(5, 10, 15, 21)) is None  # past the rows
    assert split_grouped_mm(a, b, _offs(5, 10, 20)) is None  # one offset per group


class TakesLargeGroups(RecordingOffload):
    """Takes groups with at least ``rows`` rows; leaves the rest to the caller."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def start(
        self,
        name: str,
        op: str,
        a: torch.Tensor,
        b: torch.Tensor,
        done: GemmDone,
        unfold: Unfold | None = None,
    ) -> int:
        if op == TileOp.MM and a.shape[0] < self.rows:
            return 0
        return super().start(name, op, a, b, done, unfold)


def test_the_executor_sends_the_groups_it_can_and_computes_the_rest_here() -> None:
    job = make_moe_job()
    x, y = job.next_batch()
    traced = trace_step(job, x, y)
    params = [p.detach() for p in job.model.parameters()]
    buffers = [b.detach() for b in job.model.buffers()]
    want, _ = DataflowExecutor(None).run(traced, [*params, *buffers, x, y])
    offload = TakesLargeGroups(rows=130)
    got, stats = DataflowExecutor(offload).run(traced, [*params, *buffers, x, y])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    kept = dict(stats.flops.kept)
    assert stats.flops.workers > 0 and kept.get("_grouped_mm", 0) > 0, (stats.flops, kept)
    assert any(".g" in name for name, _, _ in offload.calls)


def test_a_moe_model_trains_like_local_torch_with_its_experts_on_workers() -> None:
    offload = RecordingOffload()
    trainer = Trainer(make_moe_job(), offload)
    losses = [r.loss for r in trainer.run(5)]
    want = train_locally(make_moe_job(), 5)
    for got, ref in zip(losses, want, strict=True):
        assert abs(got - ref) <= 1e-5 * abs(ref)
    grouped = [name for name, _, _ in offload.calls if ".g" in name]
    assert len(grouped) >= 5 * 2 * 2 * 3, len(grouped)  # steps x layers x projections x passes
