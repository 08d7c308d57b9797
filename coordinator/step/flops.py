"""Every op's FLOPs, and who computed them: the share of a step that workers did.

Counts follow ``torch.utils.flop_counter`` (a multiply-add is 2 FLOPs; GEMMs,
convolutions and attention count, elementwise ops count 0), so the figures read like
torch's own ``FlopCounterMode``, with the formulas torch lacks or gets wrong added: the CPU
flash-attention kernels, grouped GEMMs, Cleave's convolution GEMM, and a grouped
convolution's backward (torch counts its weight gradient ``groups`` times over). What stays
at the coordinator is tallied by op, with the reason in words, so an operator sees what
keeps the workers' share below 100%. An op that does heavy arithmetic but has no formula
is named as uncounted, and the workers' share is then only an upper bound: it is never
shown as a figure that quietly leaves such work out.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

import coordinator.step.lowering  # noqa: F401  (registers cleave::unfold_mm, counted here)
from coordinator.step.grouped_mm import grouped_mm_flops

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


def _convolution_backward(
    grad_out: Any,
    x: Any,
    w: Any,
    bias: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
    groups: int,
    output_mask: Any,
    *args: Any,
    out_val: Any = None,
    **kwargs: Any,
) -> int:
    """Each gradient asked for costs what the forward does: one multiply-add per pair of
    an output position and a weight element (the weight's shape already holds C/groups).
    Output positions are the output's for a convolution, the input's for a transposed one."""
    positions = math.prod((x if transposed else grad_out).shape[2:])
    forward = 2 * x.shape[0] * positions * math.prod(w.shape)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def _recurrent_gemms(x: Any, w_ih: Any, w_hh: Any) -> int:
    """One pass of a recurrent layer's GEMMs: at each of its T·B positions, the input's
    and the hidden state's projections onto the G·H gate rows (``w_ih [G·H, I]``,
    ``w_hh [G·H, H]``)."""
    positions = x.numel() // x.shape[-1]
    return 2 * positions * w_ih.shape[0] * (w_ih.shape[1] + w_hh.shape[1])


def _mkldnn_rnn(x: Any, w_ih: Any, w_hh: Any, *args: Any, out_val: Any = None, **kw: Any) -> int:
    return _recurrent_gemms(x, w_ih, w_hh)


def _mkldnn_rnn_backward(x: Any, w_ih: Any, w_hh: Any, *args: Any, **kwargs: Any) -> int:
    """The input's and hidden state's gradients, then both weights' gradients: twice
    the forward's products."""
    return 2 * _recurrent_gemms(x, w_ih, w_hh)


def _mv(a: Any, x: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return 2 * a.shape[0] * a.shape[1]


def _addmv(bias: Any, a: Any, x: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return 2 * a.shape[0] * a.shape[1]


def _dot(x: Any, y: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return 2 * x.shape[0]


# Formulas torch's registry lacks (the CPU flash kernels, the ones a CPU coordinator meets;
# grouped GEMMs; Cleave's own convolution GEMM; oneDNN's fused recurrent layers, which
# nn.LSTM runs as on a CPU; products with a vector) or overstates (grouped convolutions'
# backward); these take precedence over torch's.
_EXTRA = {
    aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_backward,
    aten._grouped_mm: grouped_mm_flops,
    aten.convolution_backward: _convolution_backward,
    torch.ops.cleave.unfold_mm: _unfold_mm,
    aten.mkldnn_rnn_layer: _mkldnn_rnn,
    aten.mkldnn_rnn_layer_backward: _mkldnn_rnn_backward,
    aten.mv: _mv,
    aten.addmv: _addmv,
    aten.dot: _dot,
    aten.vdot: _dot,
}
FORMULAS: dict[Any, Any] = {**flop_registry, **_EXTRA}

# Words in an aten op's name that mark heavy arithmetic (products, convolutions,
# attention, decompositions, transforms, recurrent cells). One of these without a formula
# is named as uncounted rather than silently counted as 0.
_HEAVY_WORDS = frozenset(
    "mm bmm addmm baddbmm addbmm mv addmv dot vdot addr ger matmul einsum tensordot bilinear "
    "attention linalg fft rfft irfft ifft hfft cdist cholesky triangular lu qr svd eig eigh "
    "inverse solve lstm gru rnn".split()
)
# Ops whose names hold such a word but that only read their input once (a norm of a
# vector, as gradient clipping takes): counted as 0, like other elementwise work.
_LIGHT = frozenset({"linalg_vector_norm"})

DEPTHWISE = "depthwise convolution"  # forward and backward, tallied under one name

# Why an op's FLOPs stayed at the coordinator, by op name.
_PLANNER = (
    "the planner kept it here: too small to tile, too few FLOPs per byte to be worth"
    " handing out, or faster here than as tiles"
)
_NARROW_CONVOLUTION = (
    "fewer than 8 output channels per group (an image's colours, a grouped convolution's"
    " narrow groups): no GEMM lowering"
)
KEPT_WHY = {
    "mm": _PLANNER,
    "addmm": _PLANNER,
    "bmm": _PLANNER,
    "unfold_mm": _PLANNER,
    "_grouped_mm": (
        "the planner kept its groups here (too small to tile, or faster here than as tiles),"
        " or the call has a bias or an output dtype unlike its operands'"
    ),
    DEPTHWISE: (
        "one input channel a group: its weight gradient, most of its work, has no check"
        " cheaper than computing it, so sending it out would cost the coordinator about as"
        " much as computing it here (bench/bench_depthwise.py)"
    ),
    "convolution": _NARROW_CONVOLUTION,
    "convolution_backward": _NARROW_CONVOLUTION,
}
_FUSED_RNN = (
    "a recurrent layer oneDNN runs as one fused op (nn.LSTM on a CPU): its GEMMs cannot be"
    " cut into tiles; run the model under torch.backends.mkldnn.flags(enabled=False) to"
    " hand them to workers, one small GEMM per time step"
)
KEPT_WHY["mkldnn_rnn_layer"] = KEPT_WHY["mkldnn_rnn_layer_backward"] = _FUSED_RNN
STRANDED = "stranded tiles"
KEPT_WHY[STRANDED] = (
    "no connected worker could take them (refused by all, or over every memory cap)"
)
DEFAULT_WHY = "no tile kind for this op: it runs at the coordinator"


def op_flops(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> int:
    """FLOPs of one aten call, from its arguments' and result's shapes (tensors or fx meta)."""
    packet = getattr(func, "overloadpacket", None)
    formula: Any = FORMULAS.get(packet)
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

    if any(meta(n) is None for n in node.all_input_nodes):
        # A constant make_fx kept no value of (a sparse matrix the model holds): no
        # shapes to count from. Its products run here and cost its nonzeros, not m·n·k.
        return 0
    args = torch.fx.node.map_arg(node.args, meta)
    kwargs = torch.fx.node.map_arg(node.kwargs, meta)
    return op_flops(node.target, args, kwargs, node.meta.get("val"))  # type: ignore[arg-type]


def op_name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", func)
    return str(getattr(packet, "__name__", packet))


def op_label(func: Any, args: tuple[Any, ...]) -> str:
    """The name an op's FLOPs are tallied under when they stay here: its aten name, but
    forward and backward of a depthwise convolution as one, since its reason differs."""
    name = op_name(func)
    if name not in ("convolution", "convolution_backward"):
        return name
    x, transposed, groups = (
        (args[0], args[6], args[8]) if name == "convolution" else (args[1], args[7], args[9])
    )
    depthwise = not transposed and int(groups) > 1 and x.shape[1] == int(groups)
    return DEPTHWISE if depthwise else name


def node_label(node: Node) -> str:
    """``op_label`` of a traced node, from the shapes make_fx recorded."""
    if node.op != "call_function":
        return node.name
    args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    return op_label(node.target, args)  # type: ignore[arg-type]


@functools.cache
def uncounted(func: Any) -> bool:
    """Whether ``func`` does heavy arithmetic that no formula here counts."""
    if getattr(func, "overloadpacket", None) in FORMULAS or op_name(func) in _LIGHT:
        return False
    words = [w for w in op_name(func).lower().split("_") if w]
    return any(w in _HEAVY_WORDS or w.startswith("conv") or w.endswith("mm") for w in words)


@dataclass
class FlopTally:
    """One step's FLOPs: those handed to workers and those computed here, by op."""

    workers: int = 0
    kept: dict[str, int] = field(default_factory=dict)
    uncounted: set[str] = field(default_factory=set)  # heavy ops run here with no formula

    def keep(self, op: str, flops: int) -> None:
        if flops > 0:
            self.kept[op] = self.kept.get(op, 0) + flops

    def ran_here(self, func: Any, flops: int, label: str | None = None) -> None:
        """An aten call computed at the coordinator, with its FLOPs from ``op_flops`` and,
        where it differs from the op's name, its ``op_label``."""
        if flops > 0:
            self.keep(label or op_name(func), flops)
        elif uncounted(func):
            self.uncounted.add(op_name(func))

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
        """Of the FLOPs counted; with ``uncounted`` ops, an upper bound on the true share."""
        return self.workers / self.total if self.total else None

    def summary(self) -> dict[str, Any]:
        """What ``/api/status`` and the run summary show. ``uncounted`` names heavy ops
        with no formula that ran here: ``workers_share`` is then at most the true share."""
        return {
            "gflop": round(self.total / 1e9, 4),
            "workers_gflop": round(self.workers / 1e9, 4),
            "workers_share": None if self.workers_share is None else round(self.workers_share, 4),
            "kept_here": kept_here(self.kept.items(), self.total),
            "uncounted": sorted(self.uncounted),
        }


# A step whose workers computed less than this share of its FLOPs is worth a word in the
# log: the pool then does little for the model, and the kept ops say why.
MOSTLY_KEPT_BELOW = 0.5


def mostly_kept(tally: FlopTally) -> str | None:
    """The op that kept the most of a step's FLOPs at the coordinator, where workers
    computed less than ``MOSTLY_KEPT_BELOW`` of them; None otherwise."""
    share = tally.workers_share
    if share is None or share >= MOSTLY_KEPT_BELOW or not tally.kept:
        return None
    return max(tally.kept.items(), key=lambda kv: kv[1])[0]


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
    uncounted_ops = summary.get("uncounted") or []
    if share is None and not uncounted_ops:
        return "this step has no FLOPs to count"
    if share is None:
        text = "workers computed none of this step's counted FLOPs"
    else:
        at_most = "at most " if uncounted_ops else ""
        text = f"workers computed {at_most}{share:.1%} of this step's {summary['gflop']:.2f} GFLOP"
    kept = summary.get("kept_here") or []
    if kept:
        text += "; kept here: " + ", ".join(
            f"{k['op']} {_percent(k['share'])} ({k['why']})" for k in kept[:4]
        )
    if uncounted_ops:
        text += "; also ran here, heavy and not counted (no FLOP formula): " + ", ".join(
            uncounted_ops
        )
    return text


def _percent(share: float) -> str:
    return "<0.01%" if 0 < share < 1e-4 else f"{share:.2%}"
