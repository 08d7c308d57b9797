"""Draw docs/bench/*.svg from the latest tables in docs/benchmarks.md.

    python bench/plots.py          # or `make plots`, which also re-runs the simulator's report

Each bench prints its table; the latest runs are pasted into docs/benchmarks.md, and this
script reads them back from there (each by a line of its header), so the pictures always
show the tables beside them. A table that is missing or changed its columns stops the
script with its name rather than drawing something else.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.sim.svg import bar_chart  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
OUT = ROOT / "docs" / "bench"


def fenced_tables(markdown: str) -> list[list[str]]:
    """The lines of every fenced block, in order."""
    return [
        block.strip("\n").splitlines()
        for block in re.findall(r"^```\n(.*?)^```", markdown, re.S | re.M)
    ]


def table(markdown: str, header_has: str) -> list[str]:
    """The data rows of the fenced table whose first line contains ``header_has`` (its
    closing note in parentheses left out)."""
    for lines in fenced_tables(markdown):
        if lines and header_has in lines[0]:
            return [line for line in lines[1:] if line.strip() and not line.startswith("(")]
    raise SystemExit(f"{DOC}: no table whose header has {header_has!r}")


def shape_label(*dims: str) -> str:
    """ "512³" for a cube, "16×256×64×256" otherwise."""
    dims = tuple(d.strip() for d in dims)
    return f"{dims[0]}³" if len(dims) == 3 and len(set(dims)) == 1 else "×".join(dims)


def tile_path(markdown: str) -> str:
    """bench_tile.py: the worker's pipelined tile path over bare matmul, fp32."""
    groups: dict[str, dict[str, float]] = {}
    row = re.compile(r"\s*(\d+) x (\d+) x (\d+)\s+(\w+)\s+(\d+)\s+\S+\s+\S+\s+\S+\s+\S+\s+(\S+)")
    for line in table(markdown, "pipelined"):
        m, k, n, dtype, threads, pipelined = row.match(line).groups()  # type: ignore[union-attr]
        if dtype == "float32":
            shape = shape_label(m, k, n)
            groups.setdefault(shape, {})[f"{threads} thread{'s' * (threads != '1')}"] = float(
                pipelined
            )
    return bar_chart(
        "Worker tile path over bare torch.matmul (fp32, pipelined)",
        "ratio (1 = as fast as matmul)",
        groups,
        goal=0.95,
        goal_label="goal from 1024³",
    )


def orchestration(markdown: str) -> str:
    """bench_step.py: the coordinator's CPU per step over eager torch's, and its floor."""
    groups: dict[str, dict[str, float]] = {}
    for line in table(markdown, "orch/floor"):
        name, *cols = line.rsplit(None, 11)
        orch, floor = float(cols[6]), float(cols[8])
        groups[name.strip().split(",")[0]] = {"orchestration": orch, "floor": floor}
    return bar_chart(
        "Coordinator CPU per step over eager torch's",
        "CPU-second ratio",
        groups,
    )


def check_cost(markdown: str) -> str:
    """bench_verify.py: the result check's CPU over the tile's GEMM, fp32."""
    groups: dict[str, dict[str, float]] = {}
    for line in table(markdown, "flop ratio"):
        shape, _, rest = line.partition("float32")
        layout, *cols = rest.split() or [""]
        if layout != "rows":  # fp32 blocks in row order; the rest are in the table
            continue
        groups[shape_label(*shape.split(" x "))] = {
            "one tile": float(cols[2]),
            "in a grid": float(cols[4]),
            "batched": float(cols[6]),
        }
    return bar_chart(
        "Result check over the tile's GEMM (fp32, one thread)",
        "CPU ratio",
        groups,
        goal=0.08,
        goal_label="goal at 1024³",
    )


PLOTS: dict[str, Callable[[str], str]] = {
    "tile_path.svg": tile_path,
    "orchestration.svg": orchestration,
    "check_cost.svg": check_cost,
}


def main() -> int:
    markdown = DOC.read_text()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, draw in PLOTS.items():
        (OUT / name).write_text(draw(markdown))
        print(f"wrote {(OUT / name).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
