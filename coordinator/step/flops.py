"""Every op's FLOPs, and who computed them: the share of a step that workers did.

Counts follow ``torch.utils.flop_counter`` (a multiply-add is 2 FLOPs; GEMMs,
convolutions and attention count, elementwise ops count 0), so the figures read like
torch's own ``FlopCounterMode``. What stays at the coordinator is tallied by op, with the
reason in words, so an operator sees what keeps the workers' share below 100%.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

import coordinator.step.lowering  # noqa: F401  (registers cleave::unfold_mm, counted here)

aten = torch.ops.aten


def _flash_cpu(q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(q.shape, k.shape, v.shape))


def _flash_cpu_backward(go: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(go.shape, q.shape, k.shape, v.shape))


def _unfold_mm(a: Any, b: Any, operand: str, *args: Any, out_val: Any = None, **kw: Any) -> int:
    """A convolution's GEMM: 2·M·N·K, K taken from the operand that is not an image."""
    rows, cols = out_val.shape
    depth = b.shape[0] if operand == "a" else a.shape[1]
    return 2 * rows * cols * depth


# torch's registry lacks the CPU flash kernels, the ones a CPU coordinator meets, and
# Cleave's own convolution GEMM.
_EXTRA = {
    aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_backward,
    torch.ops.cleave.unfold_mm: _unfold_mm,
}

# Why an op's FLOPs stayed at the coordinator, by op name.
_PLANNER = "the planner kept it here: too small to tile, or faster here than as tiles"
KEPT_WHY = {
    "mm": _PLANNER,
    "addmm": _PLANNER,
    "bmm": _PLANNER,
    "unfold_mm": _PLANNER,
    "convolution": (
        "transposed, 3-D, or grouped with fewer than 8 output channels per group: no GEMM lowering"
    ),
    "convolution_backward": (
        "transposed, 3-D, or grouped with fewer than 8 output channels per group: no GEMM lowering"
    ),
}
STRANDED = "stranded tiles"
KEPT_WHY[STRANDED] = (
    "no connected worker could take them (refused by all, or over every memory cap)"
)
DEFAULT_WHY = "no tile kind for this op: it runs at the coordinator"


def op_flops(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> int:
    """FLOPs of one aten call, from its arguments' and result's shapes (tensors or fx meta)."""
    packet = getattr(func, "overloadpacket", None)
    formula: Any = flop_registry.get(packet) or _EXTRA.get(packet)  # type: ignore[arg-type]
    if formula is None:
        return 0
    # torch's formulas take the call's own arguments and read the shapes themselves.
    return int(formula(*args, out_val=out, **kwargs))


def node_flops(node: Node) -> int:
    """FLOPs of a traced node, from the shapes make_fx recorded."""
    if node.op != "call_function":
        return 0

    def meta(n: Node) -> Any:
        return n.meta.get("val")

    args = torch.fx.node.map_arg(node.args, meta)
    kwargs = torch.fx.node.map_arg(node.kwargs, meta)
    return op_flops(node.target, args, kwargs, node.meta.get("val"))  # type: ignore[arg-type]


def op_name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", func)
    return str(getattr(packet, "__name__", packet))


@dataclass
class FlopTally:
    """One step's FLOPs: those handed to workers and those computed here, by op."""

    workers: int = 0
    kept: dict[str, int] = field(default_factory=dict)

    def keep(self, op: str, flops: int) -> None:
        if flops > 0:
            self.kept[op] = self.kept.get(op, 0) + flops

    def computed_here_after_all(self, flops: int) -> None:
        """Offloaded tiles that the server had to compute itself (stranded)."""
        flops = min(flops, self.workers)
        self.workers -= flops
        self.keep(STRANDED, flops)

    @property
    def total(self) -> int:
        return self.workers + sum(self.kept.values())

    @property
    def workers_share(self) -> float | None:
        return self.workers / self.total if self.total else None

    def summary(self) -> dict[str, Any]:
        """What ``/api/status`` and the run summary show."""
        return {
            "gflop": round(self.total / 1e9, 4),
            "workers_gflop": round(self.workers / 1e9, 4),
            "workers_share": None if self.workers_share is None else round(self.workers_share, 4),
            "kept_here": kept_here(self.kept.items(), self.total),
        }


def kept_here(kept: Iterable[tuple[str, int]], total: int) -> list[dict[str, Any]]:
    rows = sorted(kept, key=lambda kv: -kv[1])
    return [
        {
            "op": op,
            "gflop": round(flops / 1e9, 4),
            "share": round(flops / total, 4) if total else 0.0,
            "why": KEPT_WHY.get(op, DEFAULT_WHY),
        }
        for op, flops in rows
    ]


def describe(summary: Mapping[str, Any]) -> str:
    """One sentence for logs and the run summary."""
    share = summary.get("workers_share")
    if share is None:
        return "this step has no FLOPs to count"
    text = f"workers computed {share:.1%} of this step's {summary['gflop']:.2f} GFLOP"
    kept = summary.get("kept_here") or []
    if kept:
        text += "; kept here: " + ", ".join(
            f"{k['op']} {_percent(k['share'])} ({k['why']})" for k in kept[:4]
        )
    return text


def _percent(share: float) -> str:
    return "<0.01%" if 0 < share < 1e-4 else f"{share:.2%}"
