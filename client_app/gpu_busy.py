"""Is the GPU busy with other programs? Asked before the worker uses it ("only when free").

NVIDIA's management library (NVML, the ``pynvml`` module from the ``nvidia-ml-py``
package) answers where it is installed; it is deliberately not a dependency, since most
volunteers have no NVIDIA GPU. Without it the answer is UNKNOWN and callers decide (the
worker treats unknown as free: refusing every GPU we cannot inspect would make the
setting mean "never use the GPU").

``classify`` is the pure rule; ``query_nvidia`` is the thin I/O around it, with the
NVML module injectable so that tests need neither the library nor a GPU.
"""

from __future__ import annotations

import enum
import importlib
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

BUSY_UTILIZATION_PERCENT = 10  # GPU busier than this with other programs' work is "busy"


class GpuUse(enum.Enum):
    FREE = "free"
    BUSY = "busy"
    UNKNOWN = "unknown"


def classify(
    other_pids: Iterable[int],
    utilization_percent: float | None,
    *,
    own_busy: bool = False,
    threshold_percent: float = BUSY_UTILIZATION_PERCENT,
) -> GpuUse:
    """The GPU's state from what the driver reports.

    Another program with a compute or graphics context on the GPU makes it busy
    (a game or a training run holds one while it works). The utilization counter cannot
    tell whose kernels ran, so it counts only while we are not computing ourselves.
    A desktop compositor also holds a graphics context on many machines, hence the
    caller passes only the processes it cares about.
    """
    if any(True for _ in other_pids):
        return GpuUse.BUSY
    if utilization_percent is None:
        return GpuUse.UNKNOWN if own_busy else GpuUse.FREE
    if not own_busy and utilization_percent > threshold_percent:
        return GpuUse.BUSY
    return GpuUse.FREE


def load_nvml() -> Any | None:
    """The ``pynvml`` module, or None where nvidia-ml-py is not installed."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def ask_nvml(lib: Any, question: Callable[[Any], T]) -> T | None:
    """``question(lib)`` between NVML's init and shutdown; None if any NVML call fails
    (no driver, no NVIDIA GPU, a query the device does not support)."""
    try:
        lib.nvmlInit()
    except Exception:  # NVMLError: the library has no base class to catch
        return None
    try:
        return question(lib)
    except Exception:  # NVMLError_NotSupported and friends: say so rather than guess
        return None
    finally:
        try:
            lib.nvmlShutdown()
        except Exception:  # shutting down a half-initialized library must not mask the answer
            pass


def query_nvidia(
    device_index: int = 0,
    *,
    own_pid: int | None = None,
    own_busy: bool = False,
    nvml: Any | None = None,
) -> GpuUse:
    """Ask NVML about GPU ``device_index``; UNKNOWN without NVML or on any NVML error.

    Only compute contexts count as other programs' use: graphics contexts include the
    desktop itself, which would make the GPU look busy forever.
    """
    lib = nvml if nvml is not None else load_nvml()
    if lib is None:
        return GpuUse.UNKNOWN
    me = os.getpid() if own_pid is None else own_pid

    def ask(lib: Any) -> tuple[list[int], float]:
        handle = lib.nvmlDeviceGetHandleByIndex(device_index)
        procs = lib.nvmlDeviceGetComputeRunningProcesses(handle)
        return [p.pid for p in procs if p.pid != me], float(
            lib.nvmlDeviceGetUtilizationRates(handle).gpu
        )

    answer = ask_nvml(lib, ask)
    if answer is None:
        return GpuUse.UNKNOWN
    others, utilization = answer
    return classify(others, utilization, own_busy=own_busy)
