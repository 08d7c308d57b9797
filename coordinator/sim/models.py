"""GEMM shapes of one training step of real model configurations (shapes only).

Per transformer layer, for T = batch x seq tokens, hidden h, FFN f, H heads of d = h / H:
every linear Y[T, o] = X[T, i] W[i, o] is one forward mm and two backward ones
(dX = dY Wᵀ: M=T, K=o, N=i; dW = Xᵀ dY: M=i, K=T, N=o), and attention adds two bmm's
forward (scores Q Kᵀ, then P V) and four backward, each over batch x H slices.

GEMMs are grouped into stages: a stage's GEMMs are independent and go out together, the
next stage waits for all of them. That is stricter than the dataflow executor (which
also overlaps, e.g., a layer's dW with the next layer's dX), so simulated steps err slow.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.plan.planner import GemmShape


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    vocab: int
    gated_ffn: bool = False  # Llama: gate and up projections, then down

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("opt-125m", 12, 768, 3072, 12, 50272),
        ModelShape("opt-350m", 24, 1024, 4096, 16, 50272),
        ModelShape("opt-1.3b", 24, 2048, 8192, 32, 50272),
        ModelShape("opt-2.7b", 32, 2560, 10240, 32, 50272),
        ModelShape("opt-6.7b", 32, 4096, 16384, 32, 50272),
        ModelShape("opt-13b", 40, 5120, 20480, 40, 50272),
        ModelShape("llama-2-7b", 32, 4096, 11008, 32, 32000, gated_ffn=True),
        ModelShape("llama-2-13b", 40, 5120, 13824, 40, 32000, gated_ffn=True),
    )
}

Stage = list[tuple[str, GemmShape]]  # (name, shape) of GEMMs that run together


def _linear_fwd(name: str, tokens: int, n_in: int, n_out: int, itemsize: int) -> tuple:
    return (f"{name}.fwd", GemmShape("mm", 1, tokens, n_out, n_in, itemsize))


def _linear_bwd(name: str, tokens: int, n_in: int, n_out: int, itemsize: int) -> Stage:
    return [
        (f"{name}.dx", GemmShape("mm", 1, tokens, n_in, n_out, itemsize)),
        (f"{name}.dw", GemmShape("mm", 1, n_in, n_out, tokens, itemsize)),
    ]


def step_stages(model: ModelShape, batch: int, seq: int, itemsize: int = 4) -> list[Stage]:
    """Forward then backward stages of one training step, in execution order."""
    t, h, f, d = batch * seq, model.hidden, model.ffn, model.head_dim
    bh = batch * model.heads
    up = ["gate", "up"] if model.gated_ffn else ["fc1"]
    down = "down" if model.gated_ffn else "fc2"
    forward: list[Stage] = []
    backward: list[Stage] = []
    for layer in range(model.layers):
        p = f"l{layer}."
        forward += [
            [_linear_fwd(p + x, t, h, h, itemsize) for x in ("q", "k", "v")],
            [(p + "scores.fwd", GemmShape("bmm", bh, seq, seq, d, itemsize))],
            [(p + "pv.fwd", GemmShape("bmm", bh, seq, d, seq, itemsize))],
            [_linear_fwd(p + "o", t, h, h, itemsize)],
            [_linear_fwd(p + x, t, h, f, itemsize) for x in up],
            [_linear_fwd(p + down, t, f, h, itemsize)],
        ]
        layer_bwd: list[Stage] = [
            _linear_bwd(p + down, t, f, h, itemsize),
            [g for x in up for g in _linear_bwd(p + x, t, h, f, itemsize)],
            _linear_bwd(p + "o", t, h, h, itemsize),
            [  # O = P V: dP = dO Vᵀ, dV = Pᵀ dO
                (p + "pv.dp", GemmShape("bmm", bh, seq, seq, d, itemsize)),
                (p + "pv.dv", GemmShape("bmm", bh, seq, d, seq, itemsize)),
            ],
            [  # S = Q Kᵀ: dQ = dS K, dK = dSᵀ Q
                (p + "scores.dq", GemmShape("bmm", bh, seq, d, seq, itemsize)),
                (p + "scores.dk", GemmShape("bmm", bh, seq, d, seq, itemsize)),
            ],
            [g for x in ("q", "k", "v") for g in _linear_bwd(p + x, t, h, h, itemsize)],
        ]
        backward = layer_bwd + backward
    head_fwd = [_linear_fwd("lm_head", t, h, model.vocab, itemsize)]
    head_bwd = _linear_bwd("lm_head", t, h, model.vocab, itemsize)
    return forward + [head_fwd, head_bwd] + backward


def param_count(model: ModelShape) -> int:
    """The weights the optimizer steps (biases, norms and position embeddings, a fraction
    of a percent, left out): what coordinator ranks all-reduce as gradients each step.
    The LM head shares the token embedding's weights."""
    h, f = model.hidden, model.ffn
    ffn = (3 if model.gated_ffn else 2) * h * f
    return model.layers * (4 * h * h + ffn) + model.vocab * h


def step_flops(stages: list[Stage]) -> int:
    return sum(shape.flops for stage in stages for _, shape in stage)
