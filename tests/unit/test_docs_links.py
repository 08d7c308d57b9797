"""The README and the pages under docs/: every relative link and image points at a file
that exists, and every #anchor at a heading of the page it names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The page without its code blocks and inline code (which show links, not make them)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The #anchors GitHub makes of a page's headings."""
    found: set[str] = set()
    for line in prose(page.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"\w+:", t)]


def test_the_pages_are_found() -> None:
    names = {p.name for p in PAGES}
    assert {"README.md", "volunteer.md", "operator.md", "security.md", "benchmarks.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading makes #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_reaches_every_guide_and_stays_short() -> None:
    readme = ROOT / "README.md"
    reached = {Path(t.partition("#")[0]).name for t in links(readme)}
    guides = {p.name for p in PAGES if p.name != "README.md"}
    assert guides <= reached, f"not linked from the README: {sorted(guides - reached)}"
    assert len(readme.read_text().splitlines()) <= 250
