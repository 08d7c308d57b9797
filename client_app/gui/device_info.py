"""This machine's compute device, as the window names it and shows how busy it is.

Read from torch only where the worker core has imported it already: the window itself
never imports torch.
"""

from __future__ import annotations

import platform
import sys


def device_name() -> str:
    """What the settings dialog calls this machine's compute device."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return str(torch.cuda.get_device_name(0))
    return platform.processor() or platform.machine() or "CPU"


def gpu_available() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


def gpu_use() -> str:
    """The GPU's utilisation, or the memory this process holds on it where that is all
    torch can tell."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return "n/a"
    try:
        return f"{torch.cuda.utilization()}%"  # needs pynvml
    except Exception:
        used = torch.cuda.memory_allocated() / 2**20
        return f"{used:.0f} MiB"
