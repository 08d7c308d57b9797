"""Temperatures of the CPU and the NVIDIA GPU, for the owner's thermal limit.

Like ``client_app.readings``, every source that is missing or fails reads as None,
never an exception. ``cpu_celsius`` is the pure rule that picks the CPU's figure out of
psutil's sensor table; the sources are the thin I/O around it, with psutil and NVML
injectable so that tests need neither sensors nor a GPU.

Where no source exists the owner's limit cannot apply: ``cpu_sensor_missing`` and
``gpu_sensor_missing`` say why in words the settings show next to the greyed-out field.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil

from client_app import gpu_busy

log = logging.getLogger(__name__)

# psutil's chip names for the CPU package, best first: Intel, AMD (two drivers), ARM
# boards, then the ACPI thermal zone, which on many laptops is the CPU's neighbourhood.
CPU_CHIPS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "cpu-thermal", "acpitz")

Source = Callable[[], float | None]


def _plausible(celsius: float) -> bool:
    # 0 or absurd (or NaN): a sensor that is not wired up, not a temperature.
    return 0.0 < celsius < 150.0


def cpu_celsius(table: Mapping[str, Sequence[Any]]) -> float | None:
    """The hottest reading of the first CPU chip in ``table`` (psutil's
    ``sensors_temperatures()``: chip name -> entries with ``.current`` in °C).

    The hottest, not the package average: a thermal limit is about the part that is at
    risk, and one core at its limit is the throttling the owner wants to avoid.
    """
    for chip in CPU_CHIPS:
        readings = [
            float(entry.current)
            for entry in table.get(chip, ())
            # bool is an int: a driver's True is a flag, not one degree.
            if type(getattr(entry, "current", None)) in (int, float)
            and _plausible(float(entry.current))
        ]
        if readings:
            return max(readings)
    return None


def _psutil_table(sensors: Callable[[], Any]) -> Mapping[str, Sequence[Any]]:
    try:
        table = sensors()
    except Exception as exc:  # psutil raises on some platforms and in odd sandboxes
        log.debug("no temperature sensors: %s", exc)
        return {}
    return table if isinstance(table, Mapping) else {}


def cpu_temperature_source(
    sensors: Callable[[], Any] | None = None, platform: str | None = None
) -> Source | None:
    """A callable giving the CPU's temperature in °C, or None where none can be read.

    psutil reads temperatures on Linux and FreeBSD only; elsewhere there is no source.
    """
    plat = sys.platform if platform is None else platform
    read = sensors if sensors is not None else getattr(psutil, "sensors_temperatures", None)
    if read is None or plat.startswith(("win", "darwin")):
        return None
    if cpu_celsius(_psutil_table(read)) is None:
        return None
    return lambda: cpu_celsius(_psutil_table(read))


def cpu_sensor_missing(source: Source | None, platform: str | None = None) -> str:
    """Why the CPU limit cannot apply here ("" when a sensor exists)."""
    if source is not None:
        return ""
    plat = sys.platform if platform is None else platform
    if plat.startswith(("win", "darwin")):
        return "this system does not let programs read the CPU temperature"
    return "no CPU temperature sensor found (on Linux: load the lm-sensors modules)"


def gpu_celsius(nvml: Any, device_index: int = 0) -> float | None:
    """NVML's core temperature of GPU ``device_index``; None on any NVML error."""

    def ask(lib: Any) -> float:
        handle = lib.nvmlDeviceGetHandleByIndex(device_index)
        return float(lib.nvmlDeviceGetTemperature(handle, lib.NVML_TEMPERATURE_GPU))

    celsius = gpu_busy.ask_nvml(nvml, ask)
    return celsius if celsius is not None and _plausible(celsius) else None


def gpu_temperature_source(nvml: Any | None = None, device_index: int = 0) -> Source | None:
    """A callable giving the GPU's temperature in °C, or None without NVML (the
    optional ``nvidia-ml-py`` package) or without a GPU it can read."""
    lib = nvml if nvml is not None else gpu_busy.load_nvml()
    if lib is None or gpu_celsius(lib, device_index) is None:
        return None
    return lambda: gpu_celsius(lib, device_index)


def gpu_sensor_missing(source: Source | None, gpu_present: bool) -> str:
    """Why the GPU limit cannot apply here ("" when a sensor exists)."""
    if source is not None:
        return ""
    if not gpu_present:
        return "no graphics card is used for tiles"
    return "reading the GPU temperature needs NVIDIA's library: pip install nvidia-ml-py"
