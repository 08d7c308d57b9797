"""Reading Prometheus' text exposition back into series, for the tests of /metrics."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Series = tuple[str, tuple[tuple[str, str], ...]]


class Exposition:
    """Samples by the names a scrape exposes (``cleave_tiles_sent_total``, not the
    parser's family name ``cleave_tiles_sent``)."""

    def __init__(self) -> None:
        self.types: dict[str, str] = {}
        self.samples: dict[Series, float] = {}

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, tuple(sorted(labels.items())))]

    def series(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {labels: v for (n, labels), v in self.samples.items() if n == name}


def parse_exposition(text: str) -> Exposition:
    """Parse ``text`` with prometheus_client; raise AssertionError if a family is typed
    other than counter or gauge (a sample outside any declared family parses as
    "unknown"), lacks help, appears twice (split up), or holds a series twice."""
    out = Exposition()
    seen: set[str] = set()
    for family in text_string_to_metric_families(text):
        assert family.type in ("counter", "gauge"), f"{family.type} family {family.name}"
        assert family.documentation, f"{family.name} has no HELP"
        assert family.name not in seen, f"{family.name} split up or declared twice"
        seen.add(family.name)
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in out.samples, f"duplicate series {key}"
            out.types[sample.name] = family.type
            out.samples[key] = sample.value
    return out
