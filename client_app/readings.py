"""The machine's side of the policy: CPU load, battery, user-input idle time, GPU use,
CPU and GPU temperatures (the last two from ``client_app.thermal``).

Thin and defensive: every source that is missing or fails reads as None, never an
exception, because a worker must keep working (or keep paused) whatever the desktop
it runs on. The decisions live in ``client_app.policy``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import TypeVar

import psutil

from client_app import gpu_busy, thermal
from client_app.policy import Readings

log = logging.getLogger(__name__)

IOREG_TIMEOUT_S = 2.0

T = TypeVar("T")


class CpuSampler:
    """Other processes' CPU%, 0-100 of the whole machine, since the previous call.

    System-wide use minus this process's share, so the worker's own tiles never count
    as "the owner is busy" (which would pause it, then resume it: a flap). psutil
    measures both since its previous call, and its first call has nothing to compare
    with and returns 0.0, so the constructor primes both counters.
    """

    def __init__(self) -> None:
        self._cpus = psutil.cpu_count() or 1
        self._proc: psutil.Process | None = None
        try:
            self._proc = psutil.Process()
            self._proc.cpu_percent(interval=None)
            psutil.cpu_percent(interval=None)
        except Exception as exc:  # psutil can fail in odd sandboxes: then no reading
            log.debug("CPU sampling unavailable: %s", exc)
            self._proc = None

    def __call__(self) -> float | None:
        if self._proc is None:
            return None
        try:
            system = psutil.cpu_percent(interval=None)  # 0-100 of the machine
            own = self._proc.cpu_percent(interval=None) / self._cpus  # per-core -> machine
        except Exception as exc:
            log.debug("CPU sample failed: %s", exc)
            return None
        return min(100.0, max(0.0, system - own))


def on_battery() -> bool | None:
    """True on battery, False on mains, None without a battery (a desktop) or unknown."""
    try:
        battery = psutil.sensors_battery()
    except Exception as exc:  # psutil has no battery reading on some platforms (it raises)
        log.debug("battery unavailable: %s", exc)
        return None
    if battery is None or battery.power_plugged is None:
        return None
    return not battery.power_plugged


def gpu_busy_source() -> Callable[[], bool | None] | None:
    """A callable answering "does another program keep the GPU busy?", or None where
    there is no CUDA GPU or no NVML (``pynvml``) to ask; then the reading stays unknown.

    NVML's device 0 stands for the GPU the worker computes on (torch's default device).
    """
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        if importlib.util.find_spec("pynvml") is None:  # optional: nvidia-ml-py
            return None
    except Exception as exc:  # ImportError, or a broken driver: no GPU reading
        log.debug("no GPU-busy source: %s", exc)
        return None

    def busy() -> bool | None:
        # Once this process has a CUDA context, utilization may be our own tiles: then
        # only other programs' compute contexts count (a GPU used only by us is free).
        verdict = gpu_busy.query_nvidia(0, own_busy=torch.cuda.is_initialized())
        if verdict is gpu_busy.GpuUse.UNKNOWN:
            return None
        return verdict is gpu_busy.GpuUse.BUSY

    return busy


# ---- user-input idle time, per platform ----------------------------------------------


class _XScreenSaverInfo(ctypes.Structure):
    _fields_ = [
        ("window", ctypes.c_ulong),
        ("state", ctypes.c_int),
        ("kind", ctypes.c_int),
        ("til_or_since", ctypes.c_ulong),
        ("idle", ctypes.c_ulong),  # milliseconds since the last input
        ("event_mask", ctypes.c_ulong),
    ]


class _X11Idle:
    """libXss's XScreenSaverQueryInfo on an X11 display (Wayland sessions have none)."""

    def __init__(self) -> None:
        xlib_name = ctypes.util.find_library("X11")
        xss_name = ctypes.util.find_library("Xss")
        if not (xlib_name and xss_name):
            raise OSError("libX11 or libXss not found")
        self._xlib = ctypes.CDLL(xlib_name)
        self._xss = ctypes.CDLL(xss_name)
        self._xlib.XOpenDisplay.restype = ctypes.c_void_p
        self._xlib.XOpenDisplay.argtypes = [ctypes.c_char_p]
        self._xlib.XDefaultRootWindow.restype = ctypes.c_ulong
        self._xlib.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        self._xss.XScreenSaverAllocInfo.restype = ctypes.POINTER(_XScreenSaverInfo)
        self._xss.XScreenSaverQueryInfo.argtypes = [
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.POINTER(_XScreenSaverInfo),
        ]
        display = self._xlib.XOpenDisplay(None)
        if not display:
            raise OSError("cannot open the X display")
        self._display = display
        self._root = self._xlib.XDefaultRootWindow(display)
        self._info = self._xss.XScreenSaverAllocInfo()

    def __call__(self) -> float | None:
        if not self._xss.XScreenSaverQueryInfo(self._display, self._root, self._info):
            return None
        return float(self._info.contents.idle) / 1000.0


class _LastInputInfo(ctypes.Structure):
    _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]


def _windows_idle() -> float | None:
    windll = getattr(ctypes, "windll", None)
    if windll is None:
        return None
    info = _LastInputInfo()
    info.cbSize = ctypes.sizeof(info)
    if not windll.user32.GetLastInputInfo(ctypes.byref(info)):
        return None
    # Both are 32-bit millisecond tick counts; the mask survives the 49.7-day wrap.
    now_ms = windll.kernel32.GetTickCount() & 0xFFFFFFFF
    return ((now_ms - info.dwTime) & 0xFFFFFFFF) / 1000.0


_HID_IDLE = re.compile(r'"HIDIdleTime"\s*=\s*(\d+)')


def _macos_idle() -> float | None:
    out = subprocess.run(
        ["ioreg", "-c", "IOHIDSystem", "-d", "4"],
        capture_output=True,
        text=True,
        timeout=IOREG_TIMEOUT_S,
        check=False,
    ).stdout
    match = _HID_IDLE.search(out)
    return int(match.group(1)) / 1e9 if match else None  # nanoseconds


def user_idle_source(platform: str | None = None) -> Callable[[], float | None] | None:
    """A callable giving seconds since the last user input, or None where none exists."""
    plat = sys.platform if platform is None else platform
    try:
        if plat.startswith("win"):
            return _windows_idle
        if plat == "darwin":
            return _macos_idle
        if os.environ.get("DISPLAY"):
            return _X11Idle()
    except Exception as exc:  # a missing library or display: no source, not a crash
        log.debug("no user-input idle source: %s", exc)
    return None


class Sampler:
    """``sample()``: one ``Readings`` of this machine. Never raises."""

    def __init__(
        self,
        cpu: Callable[[], float | None] | None = None,
        user_idle: Callable[[], float | None] | None = None,
        battery: Callable[[], bool | None] = on_battery,
        gpu: Callable[[], bool | None] | None = None,
        cpu_temp: thermal.Source | None = None,
        gpu_temp: thermal.Source | None = None,
    ) -> None:
        self._cpu = CpuSampler() if cpu is None else cpu
        self._user_idle = user_idle
        self._battery = battery
        self._gpu = gpu
        self.cpu_temp = cpu_temp  # public: None says the CPU limit cannot apply here
        self.gpu_temp = gpu_temp

    @classmethod
    def for_this_machine(cls) -> Sampler:
        return cls(
            user_idle=user_idle_source(),
            gpu=gpu_busy_source(),
            cpu_temp=thermal.cpu_temperature_source(),
            gpu_temp=thermal.gpu_temperature_source(),
        )

    def __call__(self) -> Readings:
        return Readings(
            other_cpu_percent=_safely(self._cpu),
            user_idle_s=_optional(self._user_idle),
            on_battery=_safely(self._battery),
            gpu_busy=_optional(self._gpu),
            cpu_temp_c=_optional(self.cpu_temp),
            gpu_temp_c=_optional(self.gpu_temp),
        )


def _safely(source: Callable[[], T | None]) -> T | None:
    try:
        return source()
    except Exception as exc:
        log.debug("reading failed: %s", exc)
        return None


def _optional(source: Callable[[], T | None] | None) -> T | None:
    return None if source is None else _safely(source)


_default: Sampler | None = None


def shared_sampler() -> Sampler:
    """This machine's Sampler, made (and primed) on first use and shared after that."""
    global _default
    if _default is None:
        _default = Sampler.for_this_machine()
    return _default


def sample() -> Readings:
    """One reading of this machine through the shared Sampler."""
    return shared_sampler()()
