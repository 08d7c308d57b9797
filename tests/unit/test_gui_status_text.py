"""What the window and the tray say for a status: pure functions, no Qt needed."""

from __future__ import annotations

from dataclasses import replace

import pytest
from support.sample_status import JOB_STATUS

from client_app.gui.status_text import (
    MAX_DESCRIPTION_CHARS,
    MAX_NAME_CHARS,
    ZERO_WIDTH_SPACE,
    breakable,
    clean_text,
    html_for_plain,
    job_about,
    limits_line,
    progress_text,
    rank_text,
    status_line,
    tray_tooltip,
)
from client_app.gui.units import format_count, format_parameters
from client_app.status import WorkerStatus

# The window tests' status, with limits of its own for the limits line.
JOB = replace(JOB_STATUS, threads=4, cpu_percent=70, limits_mode="")
FP = JOB.coordinator_fingerprint


@pytest.mark.parametrize(
    ("changes", "sentence"),
    [
        ({}, "Computing for tiny_gpt — step 1,204 of 5,000"),
        ({"job_steps": 0}, "Computing for tiny_gpt — step 1,204"),
        ({"job_step": 0, "job_steps": 0}, "Computing for tiny_gpt"),
        ({"job_name": ""}, "Computing — step 1,204 of 5,000"),
        ({"job_name": "", "job_step": 0, "job_steps": 0}, "Computing"),
        # A rest under the CPU limit reads as computing: no flicker with every tile.
        ({"line": "Resting (CPU limit 50%)"}, "Computing for tiny_gpt — step 1,204 of 5,000"),
        ({"state": "paused", "line": "Paused: computer in use"}, "Paused: computer in use"),
        (
            {"state": "paused", "line": "Paused: CPU at 92 °C, limit 85 °C"},
            "Paused: CPU at 92 °C, limit 85 °C",
        ),
        ({"state": "paused", "line": "Paused: snoozed until 15:40"}, "Snoozed until 15:40"),
        (
            {
                "state": "waiting",
                "note": "the coordinator needs no help with this job right now; it computes "
                "faster alone",
            },
            "Connected — the coordinator needs no help with this job right now; it computes "
            "faster alone",
        ),
        ({"state": "waiting"}, "Connected — waiting for work"),
        ({"state": "waiting", "note": " \n "}, "Connected — waiting for work"),
        ({"state": "stopped", "line": "Not joined"}, "Not joined"),
    ],
)
def test_the_one_sentence(changes: dict[str, object], sentence: str) -> None:
    assert status_line(replace(JOB, **changes)) == sentence  # type: ignore[arg-type]


def test_limits_line_names_the_limits_in_force() -> None:
    in_use = replace(JOB, limits_mode="in use", cpu_percent=30, threads=1)
    assert limits_line(in_use) == "Limits while you use the computer: 30% CPU time, 1 thread"
    idle = replace(JOB, limits_mode="idle")
    assert limits_line(idle) == "Limits while the computer is idle: 70% CPU time, 4 threads"
    for mode in ("", "always"):  # before the policy decides; the same either way
        assert limits_line(replace(JOB, limits_mode=mode)) == "Limits: 70% CPU time, 4 threads"
    assert limits_line(replace(idle, device="cuda")).endswith("70% CPU time, graphics card")
    assert limits_line(replace(idle, state="waiting")).startswith("Limits while")
    # Paused or not joined, no limit is at work: nothing to say.
    assert limits_line(replace(idle, state="paused", line="Paused: on battery")) == ""
    assert limits_line(replace(idle, state="stopped")) == ""


def test_the_rank_a_worker_serves_is_said_only_when_the_job_has_several() -> None:
    assert rank_text(JOB) == "" and rank_text(replace(JOB, coordinator_ranks=1)) == ""
    ranked = replace(JOB, coordinator_rank=1, coordinator_ranks=2)
    assert rank_text(ranked, " · ") == " · coordinator rank 1 of 2"
    assert tray_tooltip(ranked).endswith(f"Key {FP}, coordinator rank 1 of 2")


def test_tray_tooltip_is_job_sentence_and_key() -> None:
    assert tray_tooltip(JOB) == (
        "Cleave — tiny_gpt, step 1,204 of 5,000\n"
        f"Computing for tiny_gpt — step 1,204 of 5,000\nKey {FP}"
    )
    # Between tiles the sentence has no step: the first line keeps it in view.
    waiting = replace(JOB, state="waiting", line="Waiting for tiles")
    assert tray_tooltip(waiting).split("\n")[:2] == [
        "Cleave — tiny_gpt, step 1,204 of 5,000",
        "Connected — waiting for work",
    ]
    bare = WorkerStatus(state="stopped", line="Not joined")
    assert tray_tooltip(bare) == "Cleave\nNot joined"


def test_job_about_is_cleaned_and_capped() -> None:
    about = job_about(JOB)
    assert (about.name, about.operator, about.link) == ("tiny_gpt", "Ada's lab", JOB.job_link)
    assert about.size == "124 M parameters"
    hostile = replace(
        JOB,
        job_name="evil\u202e\n\tname" + "x" * 500,
        job_description="para one\n\n\n\n\npara\u0007 two " + "y" * 5000,
    )
    about = job_about(hostile)
    assert len(about.name) == MAX_NAME_CHARS and about.name.endswith("…")
    assert about.name.startswith("evil name")  # no override, no line break
    assert len(about.description) == MAX_DESCRIPTION_CHARS
    assert about.description.startswith("para one\n\npara two ")
    # Markup is text like any other: kept, to be shown literally.
    assert job_about(replace(JOB, job_name="<b>x</b>")).name == "<b>x</b>"
    assert clean_text("short", 10) == "short"


def test_html_for_plain_escapes_every_markup_character() -> None:
    assert html_for_plain("<b>bold</b><img src=x>\n&amp;") == (
        "<p>&lt;b&gt;bold&lt;/b&gt;&lt;img src=x&gt;<br>&amp;amp;</p>"
    )
    assert html_for_plain("") == ""


def test_figures_for_people() -> None:
    assert progress_text(replace(JOB, job_step=0, job_steps=0)) == ""
    assert format_count(1_234_567) == "1,234,567"
    assert format_parameters(0) == ""
    assert format_parameters(850) == "850 parameters"
    assert format_parameters(420_000) == "420 k parameters"
    assert format_parameters(124_439_808) == "124 M parameters"
    assert format_parameters(1_300_000_000) == "1.3 B parameters"
    assert format_parameters(7_000_000_000) == "7 B parameters"


def test_long_words_get_break_points_and_short_ones_none() -> None:
    assert breakable("tiny_gpt on sonnets") == "tiny_gpt on sonnets"
    link = "https://example.org/a/very/long/path/to/the/job/page"
    broken = breakable(link)
    assert broken.replace(ZERO_WIDTH_SPACE, "") == link  # nothing but the break points
    assert all(len(piece) <= 24 for piece in broken.split(ZERO_WIDTH_SPACE))
    assert broken.startswith("https:" + ZERO_WIDTH_SPACE)  # after a separator
    solid = breakable("x" * 60)
    assert solid.split(ZERO_WIDTH_SPACE) == ["x" * 24, "x" * 24, "x" * 12]
