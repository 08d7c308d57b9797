"""``render_metrics``: Prometheus text format 0.0.4, checked by a strict parser written here
from the format's specification (not by the renderer's own helpers)."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from coordinator.serve.metrics import CONTENT_TYPE, escape_label_value, render_metrics

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
Series = tuple[str, tuple[tuple[str, str], ...]]


class Exposition:
    def __init__(self) -> None:
        self.types: dict[str, str] = {}
        self.helps: dict[str, str] = {}
        self.samples: dict[Series, float] = {}

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, tuple(sorted(labels.items())))]

    def series(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {labels: v for (n, labels), v in self.samples.items() if n == name}


def parse_exposition(text: str) -> Exposition:
    """Parse ``text`` strictly: every line well formed, HELP and TYPE once per family and
    before its samples, a family's samples together, no series twice, counters named
    ``*_total`` and never negative. Raises AssertionError on any violation."""
    assert text.endswith("\n"), "the exposition must end with a newline"
    out = Exposition()
    finished: set[str] = set()  # families whose samples are over
    current: str | None = None
    for number, line in enumerate(text[:-1].split("\n"), 1):
        where = f"line {number}: {line!r}"
        assert line and line == line.strip(), f"blank or padded {where}"
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            keyword, name, rest = line[2:6], *line[7:].split(" ", 1)
            assert METRIC_NAME.fullmatch(name), where
            assert name not in finished and name != current, f"{name} reopened at {where}"
            table = out.helps if keyword == "HELP" else out.types
            assert name not in table, f"second {keyword} for {name} at {where}"
            if keyword == "TYPE":
                assert rest in ("counter", "gauge"), where
                if rest == "counter":
                    assert name.endswith("_total"), f"counter {name} must end in _total"
            else:
                assert re.fullmatch(r"(?:[^\\\n]|\\\\|\\n)*", rest), f"bad HELP escape {where}"
            table[name] = rest
            continue
        assert not line.startswith("#"), f"unexpected comment {where}"
        name, labels, value = _parse_sample(line, where)
        assert name in out.types, f"sample before TYPE {where}"
        if name != current:
            if current is not None:
                finished.add(current)
            assert name not in finished, f"{name} samples split up at {where}"
            current = name
        key = (name, tuple(sorted(labels.items())))
        assert key not in out.samples, f"duplicate series {where}"
        if out.types[name] == "counter":
            assert value >= 0, f"negative counter {where}"
        out.samples[key] = value
    return out


def _parse_sample(line: str, where: str) -> tuple[str, dict[str, str], float]:
    match = METRIC_NAME.match(line)
    assert match, where
    name, i = match.group(), match.end()
    labels: dict[str, str] = {}
    if i < len(line) and line[i] == "{":
        i += 1
        while line[i] != "}":
            label = LABEL_NAME.match(line, i)
            assert label and line[label.end() : label.end() + 2] == '="', where
            i = label.end() + 2
            chars: list[str] = []
            while line[i] != '"':
                if line[i] == "\\":
                    escaped = {"\\": "\\", '"': '"', "n": "\n"}.get(line[i + 1])
                    assert escaped is not None, f"bad escape {where}"
                    chars.append(escaped)
                    i += 2
                else:
                    chars.append(line[i])
                    i += 1
            assert label.group() not in labels, f"label twice {where}"
            labels[label.group()] = "".join(chars)
            i += 1
            if line[i] == ",":
                i += 1
        i += 1
    assert line[i : i + 1] == " ", where
    text = line[i + 1 :]
    special = {"NaN": math.nan, "+Inf": math.inf, "-Inf": -math.inf}
    if text in special:
        return name, labels, special[text]
    assert re.fullmatch(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", text), f"bad value {where}"
    return name, labels, float(text)


HOSTILE = 'evil"} 1\ncleave_fake_total 99\\'


def _status(**overrides: Any) -> dict[str, Any]:
    status: dict[str, Any] = {
        "state": "training",
        "step": 12,
        "steps": 40,
        "checkpoint_step": 10,
        "history": [
            {"step": 10, "loss": 3.5, "seconds": 0.5, "tiles": 170},
            {"step": 11, "loss": 3.25, "seconds": 0.25, "tiles": 168},
        ],
        "job": "tiny_gpt",
        "coordinator_key": "d211-8e0c",
        "traffic": {"bytes_down": 1_000_000, "bytes_up": 400_000, "bytes_half": 300_000},
        "flops": {
            "gflop": 2.5,
            "workers_gflop": 2.25,
            "workers_share": 0.9,
            "kept_here": [
                {"op": "convolution", "gflop": 0.2, "share": 0.08, "why": "no GEMM lowering"},
                {"op": "mm", "gflop": 0.05, "share": 0.02, "why": "the planner kept it"},
            ],
        },
        "workers": [
            {
                "id": "w1",
                "name": "alice",
                "state": "working",
                "device": "cpu",
                "in_flight": 2,
                "tiles_session": 30,
                "refused": 0,
                "last_seen_s": 0.4,
                "key": "ab12-cd34",
                "reputation": 0.9,
                "contribution": {"tiles": 300, "gflop": 4.5},
            },
            {
                "id": "w2",
                "name": HOSTILE,
                "state": "paused",
                "device": "cuda",
                "in_flight": 0,
                "tiles_session": 3,
                "refused": 1,
                "last_seen_s": 2.0,
                "contribution": {"tiles": 3, "gflop": 0.1},
            },
        ],
        "tiles": {
            "sent": 500,
            "verified": 480,
            "reissued": 7,
            "rejected": 2,
            "refused": 1,
            "duplicates": 3,
            "computed_here": 4,
            "queued": 5,
            "pending": 6,
        },
        "banned": [{"key": "ff00", "name": "mallory", "reason": "wrong results"}],
    }
    status.update(overrides)
    return status


def test_a_full_status_parses_strictly_with_the_values_it_holds() -> None:
    parsed = parse_exposition(render_metrics(_status()))
    assert parsed.types["cleave_tiles_sent_total"] == "counter"
    assert parsed.value("cleave_tiles_sent_total") == 500
    assert parsed.value("cleave_tiles_verified_total") == 480
    assert parsed.value("cleave_tiles_reissued_total") == 7
    assert parsed.value("cleave_tiles_rejected_total") == 2
    assert parsed.value("cleave_tiles_refused_total") == 1
    assert parsed.value("cleave_tiles_computed_here_total") == 4
    assert parsed.value("cleave_tiles_queued") == 5
    assert parsed.value("cleave_tiles_pending") == 6
    assert parsed.value("cleave_bytes_down_total") == 1_000_000
    assert parsed.value("cleave_bytes_up_total") == 400_000
    assert parsed.value("cleave_bytes_half_precision_total") == 300_000
    assert parsed.value("cleave_step_gflop") == 2.5
    assert parsed.value("cleave_step_workers_flop_share") == 0.9
    assert parsed.value("cleave_step_kept_here_gflop", op="convolution") == 0.2
    assert parsed.value("cleave_step_kept_here_gflop", op="mm") == 0.05
    assert parsed.value("cleave_steps_total") == 12
    assert parsed.value("cleave_step") == 12
    assert parsed.value("cleave_steps_target") == 40
    assert parsed.value("cleave_loss") == 3.25
    assert parsed.value("cleave_step_seconds") == 0.25
    assert parsed.value("cleave_checkpoint_step") == 10
    assert parsed.value("cleave_workers_connected") == 2
    assert parsed.value("cleave_workers_active") == 1
    assert parsed.value("cleave_workers_banned") == 1
    assert parsed.value("cleave_state", state="training") == 1
    assert parsed.value("cleave_state", state="done") == 0
    assert parsed.value("cleave_info", job="tiny_gpt", coordinator_key="d211-8e0c") == 1
    assert parsed.value("cleave_worker_tiles_verified_total", id="w1", worker="alice") == 300
    assert parsed.value("cleave_worker_reputation", id="w1", worker="alice") == 0.9
    assert parsed.types["cleave_worker_tiles_verified_total"] == "counter"


def test_a_hostile_worker_name_stays_inside_its_label() -> None:
    text = render_metrics(_status())
    parsed = parse_exposition(text)
    assert parsed.value("cleave_worker_in_flight", id="w2", worker=HOSTILE) == 0
    assert "cleave_fake_total" not in parsed.types
    assert not any(name == "cleave_fake_total" for name, _ in parsed.samples)
    # Only the worker with a reputation has the series: absence is not zero.
    assert list(parsed.series("cleave_worker_reputation")) == [(("id", "w1"), ("worker", "alice"))]


def test_other_control_characters_are_replaced_not_passed_through() -> None:
    assert escape_label_value("a\rb\x00c\x7f") == "a\ufffdb\ufffdc\ufffd"
    assert escape_label_value('q"\\\n') == 'q\\"\\\\\\n'
    parsed = parse_exposition(render_metrics(_status(job="bad\rjob")))
    assert parsed.value("cleave_info", job="bad\ufffdjob", coordinator_key="d211-8e0c") == 1


def test_a_minimal_status_renders_only_what_it_knows() -> None:
    parsed = parse_exposition(render_metrics({"job": "j", "workers": [], "tiles": {}}))
    assert parsed.value("cleave_workers_connected") == 0
    assert "cleave_loss" not in parsed.types
    assert "cleave_tiles_sent_total" not in parsed.types
    assert "cleave_workers_banned" not in parsed.types  # absent field, not zero bans


def test_special_float_values_and_non_numbers() -> None:
    history = [{"step": 0, "loss": math.nan, "seconds": math.inf, "tiles": True}]
    text = render_metrics(_status(history=history, step="7"))
    parsed = parse_exposition(text)
    assert math.isnan(parsed.value("cleave_loss"))
    assert parsed.value("cleave_step_seconds") == math.inf
    assert "cleave_step_tiles" not in parsed.types  # a bool is not a count
    assert "cleave_steps_total" not in parsed.types  # nor is a string


@pytest.mark.parametrize(
    "bad",
    [
        "x_total 1\n",  # no TYPE
        "# TYPE x gauge\nx 1\nx 2\n",  # duplicate series
        '# TYPE x gauge\nx{a="\\t"} 1\n',  # bad escape
        "# TYPE x counter\nx 1\n",  # counter without _total
        "# TYPE x gauge\n# TYPE y gauge\nx 1\ny 1\nx 2\n",  # family split up
        "# TYPE x gauge\nx one\n",
    ],
)
def test_the_parser_itself_rejects_malformed_expositions(bad: str) -> None:
    with pytest.raises(AssertionError):
        parse_exposition(bad)


def test_content_type_is_the_text_format() -> None:
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")
