"""Dropout in a traced step draws the masks that eager torch draws.

Eager CPU dropout fills a tensor laid out like its input (``empty_like``) with an
in-place ``bernoulli_``. A trace is functionalised, which turns that (and a job's own
``torch.empty_like(x).bernoulli_(p)``) into the out-of-place ``bernoulli``, whose result
is contiguous. Where torch's CPU kernel fills a tensor in memory order (everywhere but
on Intel CPUs, where it takes MKL's Bernoulli stream in logical order), the mask of a
transposed input then lands on other elements than eager's: still a dropout, but not
local torch's, so the losses part from ``train_locally``. ``nn.MultiheadAttention``
with ``batch_first`` hands such a transposed output to the dropout after it in every
``nn.TransformerEncoderLayer``.

While a step is traced, ``EagerDropout`` replaces dropout and alpha dropout by eager's
own arithmetic around ``cleave::bernoulli_like``: one graph node that draws the noise
in place into a tensor laid out like the input, as eager does; ``Tensor.bernoulli_``
with a number becomes a copy of that node's draw. Feature dropout (``Dropout1d/2d/3d``)
draws into a fresh contiguous tensor in eager too, and every other random op measured
(``rand_like``, ``randn_like``, ``bernoulli`` of a tensor, ``uniform_``, ``normal_``,
``rrelu``) draws the same values traced, so they are left as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# torch's alpha dropout constant (SELU's alpha times its scale).
_ALPHA = 1.7580993408473766


@torch.library.custom_op(
    "cleave::bernoulli_like", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def bernoulli_like(like: torch.Tensor, p: float) -> torch.Tensor:
    """Bernoulli(``p``) noise laid out like ``like``, drawn as eager dropout draws it."""
    return torch.empty_like(like).bernoulli_(p)


@bernoulli_like.register_fake
def _bernoulli_like_shape(like: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(like)


def _dropout(x: torch.Tensor, p: float, inplace: bool, alpha: bool) -> torch.Tensor:
    """Eager's ``_dropout_impl`` for a training step with ``0 < p < 1``, op for op."""
    # The noise takes no gradient: the input's flows through the product below.
    noise = bernoulli_like(x.detach(), 1 - p)
    if not alpha:
        noise.div_(1 - p)
        return x.mul_(noise) if inplace else x * noise
    a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
    shift = noise.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
    noise.mul_(a)
    return (x.mul_(noise) if inplace else x * noise).add_(shift)


# Each dropout function: its argument names (input first) and defaults, whether it is
# alpha dropout, and whether it is always in place.
_Spec = tuple[tuple[str, ...], dict[str, Any], bool, bool]
_FUNCTIONS: dict[Callable[..., Any], _Spec] = {
    F.dropout: (("input", "p", "training", "inplace"), {"p": 0.5, "training": True}, False, False),
    F.alpha_dropout: (
        ("input", "p", "training", "inplace"),
        {"p": 0.5, "training": False},
        True,
        False,
    ),
    torch.dropout: (("input", "p", "train"), {}, False, False),
    torch.dropout_: (("input", "p", "train"), {}, False, True),
    torch.alpha_dropout: (("input", "p", "train"), {}, True, False),
    torch.alpha_dropout_: (("input", "p", "train"), {}, True, True),
}


class EagerDropout(TorchFunctionMode):
    """Within it, dropout and ``bernoulli_`` draw through ``cleave::bernoulli_like``."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.bernoulli_ and len(args) == 2 and not kwargs:
            x, p = args
            if isinstance(p, (int, float)) and 0 <= p <= 1:
                return x.copy_(bernoulli_like(x.detach(), float(p)))
        spec = _FUNCTIONS.get(func)
        if spec is not None:
            names, defaults, alpha, always_inplace = spec
            given = {**defaults, **dict(zip(names, args, strict=False)), **kwargs}
            x, p = given["input"], given["p"]
            training = given.get("training", given.get("train"))
            inplace = always_inplace or bool(given.get("inplace", False))
            # Anything else (evaluation, p of 0 or 1, an empty input, a p torch refuses)
            # is deterministic or an error: torch's own function does it.
            if training and isinstance(x, torch.Tensor) and 0 < p < 1 and x.numel() > 0:
                return _dropout(x, float(p), inplace, alpha)
        return func(*args, **kwargs)
