"""Small SVG line and bar charts in pure Python (no plotting dependency)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape

_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
_W, _H, _L, _R, _T, _B = 560, 340, 80, 150, 36, 48  # size and margins


def line_chart(
    title: str,
    x_label: str,
    y_label: str,
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    log_x: bool = False,
    log_y: bool = False,
) -> str:
    points = [p for pts in series.values() for p in pts if not (log_y and p[1] <= 0)]
    if not points:
        raise ValueError("line_chart needs at least one point")
    fx = math.log10 if log_x else float
    fy = math.log10 if log_y else float
    xs = [fx(x) for x, _ in points]
    ys = [fy(y) for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = (min(ys), max(ys)) if log_y else (min(0.0, min(ys)), max(ys))
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    pw, ph = _W - _L - _R, _H - _T - _B

    def px(x: float) -> float:
        return _L + (fx(x) - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return _T + ph - (fy(y) - y0) / (y1 - y0) * ph

    out = _frame(title, y_label)
    out.append(
        f'<text x="{_L + pw / 2}" y="{_H - 10}" text-anchor="middle">{escape(x_label)}</text>'
    )
    for i in range(5):
        gy = y0 + (y1 - y0) * i / 4
        value = 10**gy if log_y else gy
        y = _T + ph - ph * i / 4
        out.append(f'<line x1="{_L}" x2="{_L + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{_L - 4}" y="{y + 4:.1f}" text-anchor="end">{_fmt(value)}</text>')
    for x in sorted({x for x, _ in points}):
        out.append(
            f'<text x="{px(x):.1f}" y="{_T + ph + 14}" text-anchor="middle">{_fmt(x)}</text>'
        )
    for k, (name, pts) in enumerate(series.items()):
        colour = _COLOURS[k % len(_COLOURS)]
        kept = [(x, y) for x, y in pts if not (log_y and y <= 0)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in kept)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, y in kept:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}"/>')
        ly = _T + 14 + 16 * k
        out.append(
            f'<line x1="{_W - _R + 10}" x2="{_W - _R + 28}" y1="{ly - 4}" y2="{ly - 4}" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        out.append(f'<text x="{_W - _R + 32}" y="{ly}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _frame(title: str, y_label: str) -> list[str]:
    """A chart's opening: the canvas, its title, the plot's frame and the y axis's label."""
    pw, ph = _W - _L - _R, _H - _T - _B
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{_W}" height="{_H}" fill="white"/>',
        f'<text x="{_W / 2}" y="18" text-anchor="middle" font-size="13">{escape(title)}</text>',
        f'<rect x="{_L}" y="{_T}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>',
        f'<text transform="translate(14,{_T + ph / 2}) rotate(-90)" text-anchor="middle">'
        f"{escape(y_label)}</text>",
    ]


def _nice(value: float) -> float:
    """The smallest of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 times a power of ten that is at
    least ``value``: an axis that ends on a round number."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if m * power >= value)


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e4 or magnitude < 1e-2:
        return f"{value:.0e}"
    return f"{value:.3g}"


def bar_chart(
    title: str,
    y_label: str,
    groups: Mapping[str, Mapping[str, float]],
    *,
    goal: float | None = None,
    goal_label: str = "goal",
) -> str:
    """Grouped bars: one group per key of ``groups`` (along x), one bar per series in
    it, the series in the order they first appear; ``goal``: a dashed line across."""
    series: list[str] = []
    for bars in groups.values():
        series += [name for name in bars if name not in series]
    values = [v for bars in groups.values() for v in bars.values()]
    if not values:
        raise ValueError("bar_chart needs at least one bar")
    top = _nice(max([*values, goal or 0.0]) * 1.05)
    pw, ph = _W - _L - _R, _H - _T - _B
    slot = pw / len(groups)
    bar = slot * 0.8 / len(series)

    def py(y: float) -> float:
        return _T + ph - y / top * ph

    out = _frame(title, y_label)
    for i in range(5):
        value = top * i / 4
        y = py(value)
        out.append(f'<line x1="{_L}" x2="{_L + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{_L - 4}" y="{y + 4:.1f}" text-anchor="end">{_fmt(value)}</text>')
    for g, (group, bars) in enumerate(groups.items()):
        x0 = _L + g * slot + slot * 0.1
        for k, name in enumerate(series):
            if name not in bars:
                continue
            colour = _COLOURS[k % len(_COLOURS)]
            y = py(bars[name])
            out.append(
                f'<rect class="bar" x="{x0 + k * bar:.1f}" y="{y:.1f}" width="{bar * 0.9:.1f}" '
                f'height="{_T + ph - y:.1f}" fill="{colour}"/>'
            )
        x, y = _L + (g + 0.5) * slot, _T + ph + 14
        out.append(
            f'<text x="{x:.1f}" y="{y}" text-anchor="end" transform="rotate(-20 {x:.1f} {y})">'
            f"{escape(group)}</text>"
            if any(len(name) * 6 > slot for name in groups)  # too long to stand side by side
            else f'<text x="{x:.1f}" y="{y}" text-anchor="middle">{escape(group)}</text>'
        )
    if goal is not None:
        y = py(goal)
        out.append(
            f'<line x1="{_L}" x2="{_L + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#333" '
            'stroke-dasharray="5,4"/>'
        )
    for k, name in enumerate(series):
        ly = _T + 14 + 16 * k
        colour = _COLOURS[k % len(_COLOURS)]
        out.append(
            f'<rect x="{_W - _R + 10}" y="{ly - 9}" width="14" height="10" fill="{colour}"/>'
        )
        out.append(f'<text x="{_W - _R + 30}" y="{ly}">{escape(name)}</text>')
    if goal is not None:
        ly = _T + 14 + 16 * len(series)
        out.append(
            f'<line x1="{_W - _R + 10}" x2="{_W - _R + 24}" y1="{ly - 4}" y2="{ly - 4}" '
            'stroke="#333" stroke-dasharray="5,4"/>'
        )
        out.append(f'<text x="{_W - _R + 30}" y="{ly}">{escape(goal_label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
