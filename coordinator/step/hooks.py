"""Hooks a traced step would not run at each step, so steps with them run eagerly.

A trace runs the model's Python once; later steps run the graph. A hook's effect on the
tensors is in the graph, but what else it does (append an activation to a list, count,
log) would happen once, during the trace, and with the trace's fake tensors (shapes, no
data): a list of activations would hold objects that fail when read. Gradient hooks on
parameters would not run at all, as the trace computes gradients apart from the
parameters. Eagerly, every hook runs each step, as in local torch.

torch's own weight reparametrizations (pruning, ``weight_norm``, ``spectral_norm``)
recompute a weight in a forward pre-hook: tensor work only, which the graph holds, so
they do not keep a step from being captured.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as module_globals
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

_TENSOR_ONLY = (BasePruningMethod, WeightNorm, SpectralNorm)
_MODULE_HOOKS = (
    ("_forward_pre_hooks", "forward pre-hook (register_forward_pre_hook)"),
    ("_forward_hooks", "forward hook (register_forward_hook)"),
    ("_backward_pre_hooks", "backward pre-hook (register_full_backward_pre_hook)"),
    ("_backward_hooks", "backward hook (register_full_backward_hook)"),
)


def untraced_hooks(model: nn.Module) -> tuple[str, ...]:
    """Where the model has hooks a traced step would not run each step, in words: empty
    when it has none."""
    found = [
        f"a global {kind}"
        for attr, kind in _MODULE_HOOKS
        if getattr(module_globals, f"_global{attr}", None)
    ]
    for name, module in model.named_modules():
        for attr, kind in _MODULE_HOOKS:
            hooks = getattr(module, attr, None)
            if hooks and not all(isinstance(h, _TENSOR_ONLY) for h in hooks.values()):
                found.append(f"module {name or type(module).__name__} has a {kind}")
    for name, p in model.named_parameters():
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            found.append(
                f"parameter {name} has a gradient hook (Tensor.register_hook or "
                "register_post_accumulate_grad_hook)"
            )
    return tuple(found)


def hooks_reason(found: tuple[str, ...]) -> str:
    """Why a step with the hooks `untraced_hooks` found runs eagerly."""
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return (
        f"{found[0]}{more}: a traced step runs the model's Python once, so a hook's work "
        "besides the tensors it returns (recording activations, counting, logging) would "
        "not happen at each step, and gradient hooks would not run at all. Remove the "
        "hooks while training to capture the whole step"
    )
