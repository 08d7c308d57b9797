"""``render_metrics``: Prometheus text format 0.0.4, read back with prometheus_client's own
parser plus the checks that parser leaves out (one family per name, no series twice)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from support.exposition import parse_exposition

from coordinator.serve.metrics import CONTENT_TYPE, printable, render_metrics

HOSTILE = 'evil"} 1\ncleave_fake_total 99\\'


def _status(**overrides: Any) -> dict[str, Any]:
    status: dict[str, Any] = {
        "state": "training",
        "step": 12,
        "steps": 40,
        "checkpoint_step": 10,
        "history": [
            {"step": 10, "loss": 3.5, "seconds": 0.5, "tiles": 170},
            {
                "step": 11,
                "loss": 3.25,
                "seconds": 0.25,
                "tiles": 168,
                "orchestration_cpu_s": 0.125,
            },
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
            "uncounted": ["_fft_r2c"],
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
    assert parsed.value("cleave_step_orchestration_cpu_seconds") == 0.125
    assert parsed.value("cleave_step_kept_here_gflop", op="convolution") == 0.2
    assert parsed.value("cleave_step_kept_here_gflop", op="mm") == 0.05
    assert parsed.value("cleave_step_uncounted_op", op="_fft_r2c") == 1
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


def test_a_large_pool_counts_every_worker_and_keeps_series_for_those_listed() -> None:
    status = _status(pool={"connected": 10_000, "active": 9_000, "ledger_keys": 25_000})
    parsed = parse_exposition(render_metrics(status))
    assert parsed.value("cleave_workers_connected") == 10_000
    assert parsed.value("cleave_workers_active") == 9_000
    assert parsed.value("cleave_ledger_keys") == 25_000
    assert parsed.value("cleave_worker_tiles_verified_total", id="w1", worker="alice") == 300


def test_a_rank_labels_every_series_with_itself_and_says_how_many_ranks_there_are() -> None:
    status = _status(rank={"rank": 1, "world": 2})
    parsed = parse_exposition(render_metrics(status))
    assert parsed.value("cleave_ranks", rank="1") == 2
    assert parsed.value("cleave_tiles_sent_total", rank="1") == 500
    assert parsed.value("cleave_worker_reputation", id="w1", worker="alice", rank="1") == 0.9
    assert all(dict(labels).get("rank") == "1" for _, labels in parsed.samples)
    alone = parse_exposition(render_metrics(_status()))  # one coordinator: no rank label
    assert "cleave_ranks" not in alone.types
    assert not any("rank" in dict(labels) for _, labels in alone.samples)


def test_a_hostile_worker_name_stays_inside_its_label() -> None:
    text = render_metrics(_status())
    parsed = parse_exposition(text)
    assert parsed.value("cleave_worker_in_flight", id="w2", worker=HOSTILE) == 0
    assert "cleave_fake_total" not in parsed.types
    assert not any(name == "cleave_fake_total" for name, _ in parsed.samples)
    # Only the worker with a reputation has the series: absence is not zero.
    assert list(parsed.series("cleave_worker_reputation")) == [(("id", "w1"), ("worker", "alice"))]


def test_quotes_backslashes_and_newlines_are_escaped_and_read_back_unchanged() -> None:
    name = 'a"b\\c\nd\\"e\\n'
    workers = [{"id": "w9", "name": name, "in_flight": 1}]
    text = render_metrics({"workers": workers})
    # The format's three escapes, byte for byte: \" for a quote, \\ for a backslash, \n.
    assert 'worker="a\\"b\\\\c\\nd\\\\\\"e\\\\n"' in text
    assert parse_exposition(text).value("cleave_worker_in_flight", id="w9", worker=name) == 1


def test_other_control_characters_are_replaced_not_passed_through() -> None:
    assert printable("a\rb\x00c\x7f") == "a\ufffdb\ufffdc\ufffd"
    assert printable('q"\\\n') == 'q"\\\n'  # left to the format's own escapes
    text = render_metrics(_status(job="bad\rjob"))
    assert "\r" not in text
    parsed = parse_exposition(text)
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
        "# HELP x h\n# TYPE x gauge\nx 1\nx 2\n",  # duplicate series
        "# HELP x h\n# TYPE x gauge\n# HELP y h\n# TYPE y gauge\nx 1\ny 1\nx 2\n",  # split
        "# TYPE x gauge\nx 1\n",  # no HELP
    ],
)
def test_the_checks_reject_malformed_expositions(bad: str) -> None:
    with pytest.raises(AssertionError):
        parse_exposition(bad)


def test_content_type_is_the_text_format() -> None:
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")
