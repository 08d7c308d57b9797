"""Is the GPU busy with other programs: the pure rule, and NVML through a fake module."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from client_app.gpu_busy import GpuUse, classify, query_nvidia


def test_classify() -> None:
    assert classify([], 0.0) is GpuUse.FREE
    assert classify([1234], 0.0) is GpuUse.BUSY
    assert classify([], 80.0) is GpuUse.BUSY
    assert classify([], 80.0, own_busy=True) is GpuUse.FREE  # that load is ours
    assert classify([], None) is GpuUse.FREE
    assert classify([], None, own_busy=True) is GpuUse.UNKNOWN


class FakeNvml:
    def __init__(self, pids: list[int], gpu: int, fail_init: bool = False) -> None:
        self.pids, self.gpu, self.fail_init = pids, gpu, fail_init
        self.shut = False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return ("gpu", index)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return [SimpleNamespace(pid=p) for p in self.pids]

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        return SimpleNamespace(gpu=self.gpu)


def test_query_nvidia_ignores_our_own_process() -> None:
    nvml = FakeNvml([42], 0)
    assert query_nvidia(own_pid=42, nvml=nvml) is GpuUse.FREE and nvml.shut
    assert query_nvidia(own_pid=42, nvml=FakeNvml([42, 7], 0)) is GpuUse.BUSY
    assert query_nvidia(own_pid=42, nvml=FakeNvml([], 95)) is GpuUse.BUSY


def test_query_nvidia_without_a_driver_is_unknown() -> None:
    assert query_nvidia(nvml=FakeNvml([], 0, fail_init=True)) is GpuUse.UNKNOWN
