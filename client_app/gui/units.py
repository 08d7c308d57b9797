"""Figures for people: durations, work, data and model sizes in plain units. No Qt.

A volunteer reads these at a glance, so each keeps to two or three significant digits
and never rounds a small but real contribution down to nothing: a session of tiles
that each take milliseconds must not read "0:00:00".
"""

from __future__ import annotations

import math


def format_duration(seconds: float) -> str:
    """Time spent computing: "0.04 s", "4.2 s", "12 s", "3 min 05 s", "1 h 12 min".

    Rounded down, so a figure never claims more time than was given; hours keep
    counting past a day ("27 h 03 min"), as a counter of hours given should.
    """
    s = max(0.0, float(seconds)) if math.isfinite(seconds) else 0.0
    if s == 0.0:
        return "0 s"
    if s < 0.01:
        return "< 0.01 s"  # something was done; "0 s" would say nothing was
    if s < 1:
        return f"{math.floor(s * 100) / 100:g} s"
    if s < 10:
        return f"{math.floor(s * 10) / 10:g} s"
    whole = int(s)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        minutes, secs = divmod(whole, 60)
        return f"{minutes} min {secs:02d} s"
    hours, rest = divmod(whole, 3600)
    return f"{hours} h {rest // 60:02d} min"


def format_bytes(n: float) -> str:
    """Decimal units, as download sizes are usually shown: 999 B, 1.2 kB, 3.4 GB."""
    if n < 1000:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB", "PB"):
        value /= 1000
        if value < 999.5 or unit == "PB":
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def format_gflop(gflop: float) -> str:
    """GFLOP up to a thousand, then TFLOP and PFLOP, three significant digits."""
    for limit, unit in ((1e6, "PFLOP"), (1e3, "TFLOP")):
        if gflop >= limit:
            return f"{gflop / limit:,.3g} {unit}"
    if gflop == 0:
        return "0 GFLOP"
    return f"{gflop:.3g} GFLOP" if gflop < 100 else f"{gflop:.0f} GFLOP"


def format_count(n: int) -> str:
    """Thousands separated: 1,204."""
    return f"{n:,}"


def format_parameters(n: int) -> str:
    """A model's size as people quote it: "124 M parameters", "1.3 B parameters"."""
    if n <= 0:
        return ""
    for limit, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= limit:
            value = n / limit
            shown = f"{value:.2g}" if value < 10 else f"{value:.0f}"
            return f"{shown} {unit} parameters"
    return f"{n} parameters"
