"""What the app says and shows for a ``WorkerStatus``: pure functions, no Qt.

The core's own lines are written for logs ("Paused: snoozed until 15:40", "Waiting for
tiles (12 done)"); the window's sentence is for a glance: what this computer is doing,
for whom, and why not when it is not.

Everything the coordinator describes (job name, description, operator, link, note) is
a stranger's text: ``job_about`` clips it to lengths a window can show and drops
control characters, and the views show it as plain text only.
"""

from __future__ import annotations

import html
import re
import unicodedata
from dataclasses import dataclass

from client_app.gui.units import format_count, format_parameters
from client_app.status import WorkerStatus
from common.job_about import (
    MAX_DESCRIPTION_CHARS,
    MAX_LINK_CHARS,
    MAX_NAME_CHARS,
    MAX_NOTE_CHARS,
    MAX_OPERATOR_CHARS,
)

NOT_JOINED = WorkerStatus(state="stopped", line="Not joined")
MANUAL_PAUSE_REASON = "paused by you"

# The protocol refuses longer text already (common.job_about); clipped here all the
# same, so that no path to the window can push its controls off the screen.
LONGEST_UNBROKEN = 24  # characters: longer words get places where a line may break
ZERO_WIDTH_SPACE = "\u200b"
_SEPARATORS = re.compile(r"(?<=[/_\-.?&=#:,;@])(?=.)")

# Tray icon colours per shown state (RGB hex): a glance says whether it computes.
STATE_COLOURS = {
    "computing": "#2e9d4a",
    "waiting": "#3a78c2",
    "paused": "#e0a030",
    "snoozed": "#9a6bd0",
    "connecting": "#8c8c8c",
    "reconnecting": "#d07030",
    "refused": "#c83232",
    "stopped": "#606060",
}


def clean_text(text: str, limit: int, *, multiline: bool = False) -> str:
    """``text`` without control characters, at most ``limit`` characters ("…" ends a cut).

    Newlines survive only where ``multiline`` (a description's paragraphs); elsewhere
    every run of whitespace becomes one space, so a name stays on one line.
    """
    kept = []
    for ch in text:
        if ch == "\n" and multiline:
            kept.append(ch)
        elif ch.isspace():
            kept.append(" ")
        # Format characters include the bidirectional overrides, which would let a
        # name display as something other than what it is.
        elif unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Co", "Cn"):
            kept.append(ch)
    if multiline:
        lines = [" ".join(line.split()) for line in "".join(kept).split("\n")]
        cleaned = "\n".join(lines).strip("\n")
        while "\n\n\n" in cleaned:
            cleaned = cleaned.replace("\n\n\n", "\n\n")
    else:
        cleaned = " ".join("".join(kept).split())
    if len(cleaned) > limit:
        cleaned = cleaned[: limit - 1].rstrip() + "…"
    return cleaned


def breakable(text: str, longest: int = LONGEST_UNBROKEN) -> str:
    """``text`` with invisible break points inside words longer than ``longest``.

    A label wraps only between words, so one long word (a link, a name made of
    underscores) would set the window's minimum width; zero-width spaces, after
    separators where there are some, let it wrap like any sentence.
    """

    def split(word: str) -> str:
        if len(word) <= longest:
            return word
        pieces = _SEPARATORS.sub(ZERO_WIDTH_SPACE, word).split(ZERO_WIDTH_SPACE)
        chunks = [p[i : i + longest] for p in pieces for i in range(0, len(p), longest)]
        return ZERO_WIDTH_SPACE.join(chunks)

    return re.sub(r"\S+", lambda m: split(m.group()), text)


@dataclass(frozen=True)
class ShownJob:
    """What the volunteer helps, cleaned for display ("" for whatever is not known)."""

    name: str
    description: str
    operator: str
    link: str
    size: str  # "124 M parameters"


def job_about(status: WorkerStatus) -> ShownJob:
    return ShownJob(
        name=clean_text(status.job_name, MAX_NAME_CHARS),
        description=clean_text(status.job_description, MAX_DESCRIPTION_CHARS, multiline=True),
        operator=clean_text(status.job_operator, MAX_OPERATOR_CHARS),
        link=clean_text(status.job_link, MAX_LINK_CHARS),
        size=format_parameters(status.job_parameters),
    )


def progress_text(status: WorkerStatus) -> str:
    """ "step 1,204 of 5,000", "step 1,204" (length unknown), or "" before any step."""
    if status.job_steps > 0:
        return f"step {format_count(status.job_step)} of {format_count(status.job_steps)}"
    if status.job_step > 0:
        return f"step {format_count(status.job_step)}"
    return ""


def status_line(status: WorkerStatus) -> str:
    """The one sentence saying what the app is doing and why."""
    state = status.state
    if state == "computing":
        # A rest between tiles under the owner's CPU limit is still computing; the
        # limits line says so, and the sentence does not flicker with every tile.
        name = job_about(status).name
        sentence = f"Computing for {name}" if name else "Computing"
        progress = progress_text(status)
        return f"{sentence} — {progress}" if progress else sentence
    if state == "waiting":
        note = clean_text(status.note, MAX_NOTE_CHARS)
        return f"Connected — {note}" if note else "Connected — waiting for work"
    if state == "paused":
        reason = status.line.removeprefix("Paused: ")
        if reason.startswith("snoozed until "):
            return "Snoozed until " + reason.removeprefix("snoozed until ")
        return f"Paused: {reason}"
    if state == "refused":
        return status.line  # the core says why, in a few words
    if state == "stopped":
        return "Not joined" if status.line in ("Not joined", "Not started") else "Left"
    return status.line  # connecting / reconnecting: the core's line says it all


def limits_line(status: WorkerStatus) -> str:
    """Which of the owner's limits are in force, while there is work they limit ("" if none).

    "Limits while you use the computer: 30% CPU time, 1 thread"
    """
    if status.state not in ("computing", "waiting"):
        return ""
    parts = [f"{status.cpu_percent}% CPU time"]
    if status.device == "cuda":
        parts.append("graphics card")
    elif status.threads > 0:
        parts.append(f"{status.threads} thread" + ("" if status.threads == 1 else "s"))
    when = {
        "in use": "Limits while you use the computer",
        "idle": "Limits while the computer is idle",
    }.get(status.limits_mode, "Limits")
    return f"{when}: {', '.join(parts)}"


def tray_tooltip(status: WorkerStatus) -> str:
    """Plain text, one fact a line: the job, the sentence, the coordinator's key."""
    name = job_about(status).name
    progress = progress_text(status)
    head = f"Cleave — {name}" if name else "Cleave"
    lines = [f"{head}, {progress}" if name and progress else head, status_line(status)]
    if status.coordinator_fingerprint:
        lines.append(f"Key {status.coordinator_fingerprint}" + rank_text(status, ", "))
    return "\n".join(lines)


def rank_text(status: WorkerStatus, before: str = "") -> str:
    """ "coordinator rank 1 of 2" after ``before`` when the job has several ranks, or ""."""
    if status.coordinator_ranks <= 1:
        return ""
    return f"{before}coordinator rank {status.coordinator_rank} of {status.coordinator_ranks}"


def html_for_plain(text: str) -> str:
    """HTML that shows ``text`` exactly, markup characters included.

    For places that guess whether a string is HTML (Qt's tooltips, some desktops' tray
    tooltips): escaped, and wrapped in a paragraph so that the guess is "HTML" and the
    escapes are decoded rather than shown.
    """
    if not text:
        return ""
    return "<p>" + "<br>".join(html.escape(line) for line in text.split("\n")) + "</p>"


def shown_state(status: WorkerStatus) -> str:
    """The key of STATE_COLOURS for this status (a snooze looks unlike a pause)."""
    if status.state == "paused" and "snoozed until" in status.line:
        return "snoozed"
    return status.state
