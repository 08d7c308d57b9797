"""The worker's status for its observers: built from the pump's parts, sent on change.

``build_status`` is pure: what the session knows (phase, tile, totals), what only the
pump knows (the link, a line such as "Reconnecting in 8 s", why it was refused) and the
limits in force make one ``WorkerStatus``. ``StatusBoard`` keeps the pump's part and
the observers, and tells them a snapshot only when it differs from the last one.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from dataclasses import dataclass
from typing import Any

from client_app.session import Phase, WorkerSession
from client_app.status import StatusObserver, WorkerStatus, refusal_line

log = logging.getLogger(__name__)


class Link(str, enum.Enum):
    """What the pump knows of its connection (the session knows the rest); each value is
    also the state a status shows while the link is in it."""

    CONNECTING = "connecting"
    RECONNECTING = "reconnecting"  # waiting out a backoff
    REFUSED = "refused"  # for good: the key changed, a ban, a join token
    STOPPED = "stopped"


@dataclass(frozen=True)
class Activity:
    """What the core is doing besides the session's protocol state."""

    threads: int  # the thread cap in force
    device: str  # "cpu" or "cuda"
    resting: bool  # between tiles, under the CPU-time limit
    cpu_percent: int
    limits_mode: str = ""  # "in use" / "idle": whose limits are in force


def build_status(
    *,
    url: str,
    link: Link,
    line: str,
    detail: str,
    session: WorkerSession | None,
    activity: Activity,
) -> WorkerStatus:
    """One snapshot; ``line`` is the pump's text for a link state (may be empty)."""
    state, shown = _state_and_line(url, link, line, detail, session, activity)
    extra: dict[str, Any] = {}
    if session is not None:
        stats = session.stats
        extra = {
            "coordinator_fingerprint": session.fingerprint,
            "coordinator_rank": session.rank,
            "coordinator_ranks": session.ranks,
            "worker_id": session.worker_id,
            "current_tile": session.current_tile,
            "tiles_done": stats.tiles_done,
            "tiles_refused": stats.tiles_refused,
            "compute_s": stats.compute_s,
            "gflop_done": stats.flop_done / 1e9,
            "bytes_in": stats.bytes_in,
            "bytes_out": stats.bytes_out,
            "credit_tiles": stats.credit_tiles,
            "credit_gflop": stats.credit_gflop,
            **_job(session),
        }
    return WorkerStatus(
        state=state,
        line=shown,
        coordinator_url=url,
        detail=detail,
        threads=activity.threads,
        device=activity.device,
        cpu_percent=activity.cpu_percent,
        limits_mode=activity.limits_mode,
        **extra,
    )


def _job(session: WorkerSession) -> dict[str, Any]:
    """What the coordinator said about its job: the Welcome's description, the latest
    signed JobState's step and note."""
    out: dict[str, Any] = {}
    about = session.about
    if about is not None:
        out = {
            "job_name": about.name,
            "job_description": about.description,
            "job_operator": about.operator,
            "job_link": about.link,
            "job_parameters": about.parameters,
        }
    state = session.job_state
    if state is not None:
        out.update(job_step=state.step, job_steps=state.steps, note=state.note)
    return out


def _state_and_line(
    url: str,
    link: Link,
    line: str,
    detail: str,
    session: WorkerSession | None,
    activity: Activity,
) -> tuple[str, str]:
    if link is Link.REFUSED:
        return link.value, refusal_line(detail)
    if link is Link.STOPPED:
        return link.value, "Stopped"
    if session is not None and session.phase is Phase.READY:
        if session.paused_reason is not None:
            return "paused", f"Paused: {session.paused_reason}"
        if session.current_tile:
            return "computing", f"Computing tile {session.current_tile}"
        if activity.resting:
            # Still "computing": the worker is at work, pacing itself between tiles.
            return "computing", f"Resting (CPU limit {activity.cpu_percent}%)"
        note = session.job_state.note if session.job_state is not None else ""
        if note:
            return "waiting", f"Waiting for tiles: {note}"
        return "waiting", f"Waiting for tiles ({session.stats.tiles_done} done)"
    return link.value, line or f"Connecting to {url}"


class StatusBoard:
    """The latest snapshot, the pump's part of the next one, and who is told."""

    def __init__(self, url: str, observer: StatusObserver | None = None) -> None:
        self.url = url
        self.link = Link.CONNECTING
        self.detail = ""  # why the worker was refused
        self._line = ""
        self._observers: list[StatusObserver] = [observer] if observer else []
        self.status = WorkerStatus(state="stopped", line="Not started", coordinator_url=url)

    def add_observer(self, observer: StatusObserver) -> None:
        """Observe from now on; ``observer`` gets the current status at once."""
        self._observers.append(observer)
        observer(self.status)

    def remove_observer(self, observer: StatusObserver) -> None:
        with contextlib.suppress(ValueError):
            self._observers.remove(observer)

    def publish(self, session: WorkerSession | None, activity: Activity, line: str = "") -> None:
        """Tell observers the current status if it changed; ``line`` sets the link's text."""
        if line:
            self._line = line
        status = build_status(
            url=self.url,
            link=self.link,
            line=self._line,
            detail=self.detail,
            session=session,
            activity=activity,
        )
        if status == self.status:
            return
        self.status = status
        for observer in list(self._observers):
            try:
                observer(status)
            except Exception:  # a broken observer (GUI bug) must not stop the worker
                log.exception("status observer %r failed", observer)
