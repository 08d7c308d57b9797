"""The device profile a worker announces in its Hello: what it has and how fast it is.

The coordinator's planner sizes tiles from it (memory cap) and estimates their time
(GFLOP/s), so the numbers are measured here, not guessed from a spec sheet.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil
import torch

from client_app.compute import TileComputer
from common.gemm_speed import matmul_gflops
from common.messages import DeviceProfile

GIB = 1 << 30
MIB = 1 << 20
MAX_DEVICE_NAME_CHARS = 128  # inside the wire's max_string_chars


def default_mem_cap_bytes(ram_bytes: int) -> int:
    # A quarter of RAM keeps the owner's machine responsive; 1 GiB already holds an
    # fp32 tile of 2 x 8192 x 8192 operands, more than the planner needs per tile.
    return max(MIB, min(GIB, ram_bytes // 4))


def measure_gflops(
    computer: TileComputer,
    *,
    target_s: float = 0.02,
    n: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """fp32 GEMM throughput on ``computer``'s device under its thread cap."""
    size = n or (1024 if computer.device.type == "cuda" else 256)
    a = torch.randn(size, size, device=computer.device)
    b = torch.randn(size, size, device=computer.device)
    computer.apply_thread_cap()
    return matmul_gflops(a, b, synchronize=computer.synchronize, target_s=target_s, clock=clock)


def build_profile(
    computer: TileComputer,
    *,
    memory_mb: int = 0,
    gflops: float | None = None,
    ram_bytes: int | None = None,
) -> DeviceProfile:
    """The Hello profile; ``memory_mb`` 0 means the default cap. Run on the compute thread."""
    ram = psutil.virtual_memory().total if ram_bytes is None else ram_bytes
    mem_cap = memory_mb * MIB if memory_mb > 0 else default_mem_cap_bytes(ram)
    return DeviceProfile(
        device=computer.device.type,
        device_name=computer.device_name[:MAX_DEVICE_NAME_CHARS],
        threads=computer.threads,
        ram_bytes=ram,
        mem_cap_bytes=mem_cap,
        gflops=round(measure_gflops(computer) if gflops is None else gflops, 2),
    )


def describe_profile(profile: DeviceProfile) -> str:
    """The profile in one line for the log."""
    return (
        f"{profile.device}, {profile.device_name}, threads={profile.threads}, "
        f"{profile.gflops:.1f} GFLOP/s fp32, tile memory cap {profile.mem_cap_bytes >> 20} MiB"
    )
