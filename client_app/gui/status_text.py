"""What the app says and shows for a ``WorkerStatus``: pure functions, no Qt.

The core's own lines are written for logs ("Paused: snoozed until 15:40", "Waiting for
tiles (12 done)"); the window's status line is shorter and names the cause first.
"""

from __future__ import annotations

from client_app.status import WorkerStatus

NOT_JOINED = WorkerStatus(state="stopped", line="Not joined")
MANUAL_PAUSE_REASON = "paused by you"

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


def status_line(status: WorkerStatus) -> str:
    """The one line saying what the app is doing and why."""
    state = status.state
    if state == "computing":
        # A rest between tiles is still work under the owner's CPU limit.
        return status.line if status.line.startswith("Resting") else "Computing"
    if state == "waiting":
        return "Waiting for work"
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


def shown_state(status: WorkerStatus) -> str:
    """The key of STATE_COLOURS for this status (a snooze looks unlike a pause)."""
    if status.state == "paused" and "snoozed until" in status.line:
        return "snoozed"
    return status.state
