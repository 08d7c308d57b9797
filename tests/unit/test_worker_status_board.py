"""The worker's status: the line and state for every situation, and when observers hear."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.worker_sessions import join, new_session, task

from client_app.config import PinStore
from client_app.session import WorkerSession
from client_app.status import WorkerStatus
from client_app.status_board import Activity, Link, StatusBoard, build_status
from common.signing import generate_private_key

URL = "ws://127.0.0.1:9/ws"
IDLE = Activity(threads=2, device="cpu", resting=False, cpu_percent=100)
RESTING = Activity(threads=2, device="cpu", resting=True, cpu_percent=40)


def line(
    link: Link,
    session: WorkerSession | None = None,
    activity: Activity = IDLE,
    **pump: str,
) -> tuple[str, str]:
    """(state, line) for a link state, the pump's ``line``/``detail`` and a session."""
    status = build_status(
        url=URL,
        link=link,
        line=pump.get("line", ""),
        detail=pump.get("detail", ""),
        session=session,
        activity=activity,
    )
    return status.state, status.line


def test_the_pump_speaks_for_the_link_until_the_session_is_ready(tmp_path: Path) -> None:
    assert line(Link.CONNECTING) == ("connecting", f"Connecting to {URL}")
    assert line(Link.RECONNECTING, line="Reconnecting in 4 s") == (
        "reconnecting",
        "Reconnecting in 4 s",
    )
    assert line(Link.STOPPED) == ("stopped", "Stopped")
    assert line(Link.REFUSED, detail="this worker is banned") == (
        "refused",
        "Refused: this computer is banned by the coordinator",
    )
    session = new_session(PinStore.in_dir(tmp_path))
    assert line(Link.CONNECTING, session, line="Joining it") == ("connecting", "Joining it")


def test_a_ready_session_says_what_the_worker_does(tmp_path: Path) -> None:
    key = generate_private_key()
    session = new_session(PinStore.in_dir(tmp_path))
    join(session, key)
    assert line(Link.CONNECTING, session) == ("waiting", "Waiting for tiles (0 done)")
    # Resting under the CPU limit is still at work: "computing".
    assert line(Link.CONNECTING, session, RESTING) == ("computing", "Resting (CPU limit 40%)")
    session.receive(task(key, "t-9")[0], 0.0)
    assert session.next_tile() is not None
    assert line(Link.CONNECTING, session, RESTING) == ("computing", "Computing tile t-9")
    session.pause("on battery")
    assert line(Link.CONNECTING, session) == ("paused", "Paused: on battery")
    # A refusal or a stop outranks whatever the session was doing.
    assert line(Link.STOPPED, session) == ("stopped", "Stopped")


def test_the_snapshot_carries_the_totals_and_the_activity(tmp_path: Path) -> None:
    key = generate_private_key()
    session = new_session(PinStore.in_dir(tmp_path))
    join(session, key)
    session.stats.flop_done = 3_000_000_000
    status = build_status(
        url=URL, link=Link.CONNECTING, line="", detail="", session=session, activity=IDLE
    )
    assert status.worker_id == "w-7" and status.gflop_done == 3.0
    assert status.bytes_in == session.stats.bytes_in > 0
    assert (status.threads, status.device, status.coordinator_url) == (2, "cpu", URL)


def test_observers_hear_each_change_once_and_a_broken_one_is_survived(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[WorkerStatus] = []
    board = StatusBoard(URL, seen.append)
    late: list[WorkerStatus] = []
    board.add_observer(late.append)
    assert [s.line for s in late] == ["Not started"]  # the current status, at once
    board.publish(None, IDLE)
    board.publish(None, IDLE)  # nothing changed: nobody is told
    board.link = Link.RECONNECTING
    board.publish(None, IDLE, line="Reconnecting in 2 s")
    board.publish(None, IDLE)  # the line stays until the pump says another
    assert [s.line for s in seen] == [f"Connecting to {URL}", "Reconnecting in 2 s"]
    assert late[1:] == seen

    def broken(status: WorkerStatus) -> None:
        if status.state == "stopped":
            raise RuntimeError("a GUI bug")

    board.add_observer(broken)
    board.remove_observer(late.append)
    board.link = Link.STOPPED
    board.publish(None, IDLE)  # the broken observer goes first: the others still hear
    assert seen[-1].state == "stopped" and board.status is seen[-1]
    assert len(late) == 3 and "status observer" in caplog.text
