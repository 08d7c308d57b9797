"""``F.one_hot`` in a traced step, as one graph can hold it.

torch's own ``one_hot`` asks in Python whether every class index is in range before it
builds the result, a question on the data that stops a trace: a segmentation loss, a
VQ-VAE's code assignment or a mixture-of-experts router that calls it would run every
step eagerly. While a step is traced, ``GraphOneHot`` builds it as torch's own
decomposition for graph capture does: a comparison with ``arange``, the range checks kept
in the graph as asserts that fail at the step that breaks them, as eager does. With
``num_classes=-1`` the result's width comes from the data, and torch's function runs
(a trace then stops, and the step runs eagerly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def one_hot(indices: torch.Tensor, num_classes: int) -> torch.Tensor:
    torch._assert_async(torch.all(indices >= 0), "one_hot: Class values must be non-negative.")
    torch._assert_async(
        torch.all(indices < num_classes), "one_hot: Class values must be smaller than num_classes."
    )
    classes = torch.arange(num_classes, dtype=indices.dtype, device=indices.device)
    return (indices.unsqueeze(-1) == classes).to(torch.int64)


class GraphOneHot(TorchFunctionMode):
    """Within it, ``F.one_hot`` with a number of classes is built from tensor ops."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.one_hot:
            given = {**dict(zip(("input", "num_classes"), args, strict=False)), **kwargs}
            indices, classes = given.get("input"), given.get("num_classes", -1)
            if (
                isinstance(indices, torch.Tensor)
                and indices.dtype == torch.int64
                and isinstance(classes, int)
                and classes >= 0
            ):
                return one_hot(indices, classes)
        return func(*args, **kwargs)
