"""The benchmark pictures: drawn from the tables in docs/benchmarks.md, so a table whose
columns change must still be read right (or stop the script), and the bar chart draws
what it is given."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from coordinator.sim.svg import bar_chart

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import plots  # noqa: E402


def bar_heights(svg: str) -> list[float]:
    return [
        float(h)
        for h in re.findall(
            r'<rect class="bar" x="[\d.]+" y="[\d.]+" width="[\d.]+" height="([\d.]+)"', svg
        )
    ]


def test_a_bar_chart_draws_each_bar_to_scale_with_its_goal() -> None:
    svg = bar_chart("t", "ratio", {"a": {"x": 1.0, "y": 0.5}, "b": {"x": 0.25}}, goal=0.8)
    heights = bar_heights(svg)
    assert len(heights) == 3
    assert heights[0] == pytest.approx(2 * heights[1], rel=1e-2)
    assert heights[0] == pytest.approx(4 * heights[2], rel=1e-2)
    assert 'stroke-dasharray="5,4"' in svg and ">goal<" in svg


def test_the_pictures_are_read_from_the_tables_beside_them() -> None:
    markdown = plots.DOC.read_text()
    tile = plots.tile_path(markdown)
    assert all(label in tile for label in ("512³", "1024³", "1 thread", "2 threads"))
    orch = plots.orchestration(markdown)
    assert all(label in orch for label in ("MLP 2048x2048", "GPT 12x768", "floor"))
    check = plots.check_cost(markdown)
    assert "1024³" in check and "batched" in check
    for name in plots.PLOTS:  # every picture is shown on the page
        assert f"(bench/{name})" in markdown


def test_a_missing_table_stops_the_script_with_its_name() -> None:
    with pytest.raises(SystemExit, match="orch/floor"):
        plots.orchestration("no tables here")
