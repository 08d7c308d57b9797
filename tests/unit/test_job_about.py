"""What volunteers are told about the job: the Welcome's signed description, the signed
JobState with the step and the coordinator's note, and how the worker takes both."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from support.worker_sessions import (
    HEARTBEAT_S,
    decode,
    new_session,
    only_error,
    say_hello,
    welcomed,
)

from client_app.config import PinStore
from client_app.status_board import Activity, build_status
from common.auth import check_welcome, make_welcome
from common.errors import AuthError, ProtocolError, SignatureError
from common.frames import decode_frame, encode_frame
from common.job_about import MAX_DESCRIPTION_CHARS, JobAbout
from common.messages import (
    Hello,
    JobState,
    Welcome,
    encode_message,
    parse_message,
    sign_job_state,
    verify_job_state,
)
from common.signing import generate_private_key
from coordinator.step.progress import ALONE_NOTE, FEW_TILES_NOTE, STATE_NOTES, Progress
from coordinator.step.run_state import RunState
from coordinator.step.trainer import StepRecord

KEY = generate_private_key()
ABOUT = JobAbout(
    name="tiny_gpt",
    description="Learns to write sonnets.\nOne character at a time.",
    operator="Cleave demo",
    link="https://example.org/tiny-gpt",
    parameters=124_000_000,
)
ACTIVITY = Activity(threads=1, device="cpu", resting=False, cpu_percent=100)


def reframe(frame: bytes, **changes: Any) -> bytes:
    """``frame`` with header fields replaced, signature left as it was."""
    parsed = decode_frame(frame)
    header = {**parsed.header, **changes}
    return encode_frame(header)


# ---- the description ------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("name", "", "must not be empty"),
        ("name", "x" * 81, "at most 80"),
        ("description", "y" * (MAX_DESCRIPTION_CHARS + 1), "at most 1000"),
        ("description", "clear\x1b[2Jscreen", "U+001B"),
        ("operator", "evil\u202etxt.exe", "U+202E"),  # right-to-left override
        ("operator", "two\nlines", "U+000A"),  # only the description has paragraphs
        ("link", "javascript:alert(1)", "http:// or https://"),
        ("link", "https://a.example/ b", "without spaces"),
        ("parameters", -1, "not a count"),
    ],
)
def test_a_description_volunteers_must_not_see_is_refused(field: str, value: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("+", r"\+")):
        replace(ABOUT, **{field: value})


def test_the_welcome_carries_the_description_under_its_signature() -> None:
    session = new_session(PinStore(Path("/nonexistent/pins.json")), pin_check=lambda u, k: True)
    hello = say_hello(session, KEY, 0.0)
    assert isinstance(hello.message, Hello)
    welcome = make_welcome(
        KEY,
        hello.message,
        worker_id="w-1",
        heartbeat_interval_s=HEARTBEAT_S,
        max_frame_bytes=1 << 20,
        job="tiny_gpt",
        about=ABOUT,
    )
    frame = encode_message(welcome)
    received = parse_message(frame)
    assert isinstance(received.message, Welcome) and received.message.about == ABOUT
    assert session._challenge is not None
    # A party on the path that rewrites the description breaks the welcome's proof.
    forged = reframe(frame, about={**ABOUT.to_header(), "description": "Send me bitcoin"})
    tampered = parse_message(forged)
    assert isinstance(tampered.message, Welcome)
    with pytest.raises(AuthError):
        check_welcome(tampered.message, tampered.frame.header, session._challenge, hello.message)
    # A welcome whose description breaks the rules is malformed, signed or not.
    with pytest.raises(ProtocolError, match="U\\+0007"):
        parse_message(reframe(frame, about={**ABOUT.to_header(), "name": "bell\x07"}))
    with pytest.raises(ProtocolError, match="must be a string"):
        parse_message(reframe(frame, about={**ABOUT.to_header(), "link": 7}))

    actions = session.receive(frame, 0.0)
    assert actions.welcome is not None
    status = build_status(
        url="ws://x", link="connecting", line="", detail="", session=session, activity=ACTIVITY
    )
    assert (status.job_name, status.job_description) == (ABOUT.name, ABOUT.description)
    assert (status.job_operator, status.job_link) == (ABOUT.operator, ABOUT.link)
    assert status.job_parameters == ABOUT.parameters


def test_a_welcome_without_a_description_still_joins(tmp_path: Path) -> None:
    session = welcomed(PinStore.in_dir(tmp_path), KEY)  # make_welcome without about
    assert session.about is None
    status = build_status(
        url="ws://x", link="connecting", line="", detail="", session=session, activity=ACTIVITY
    )
    assert status.job_name == "" and status.state == "waiting"


# ---- the job's state ------------------------------------------------------------------


def test_the_job_state_is_taken_only_when_the_coordinator_signed_it(tmp_path: Path) -> None:
    session = welcomed(PinStore.in_dir(tmp_path), KEY)
    state = sign_job_state(KEY, JobState(step=1204, steps=5000, note=ALONE_NOTE))
    frame = encode_message(state)
    assert verify_job_state(parse_message(frame), KEY.public_key()) == state

    for forged in (
        reframe(frame, note="the coordinator says: install this update"),
        reframe(frame, step=4999),
        encode_message(sign_job_state(generate_private_key(), state)),  # another key
        encode_message(JobState(step=3, steps=5, note="")),  # unsigned
    ):
        actions = session.receive(forged, 1.0)
        assert only_error(actions.send).code == "bad_signature", decode(forged)
        assert session.job_state is None

    assert session.receive(frame, 1.0).send == ()
    status = build_status(
        url="ws://x", link="connecting", line="", detail="", session=session, activity=ACTIVITY
    )
    assert (status.job_step, status.job_steps, status.note) == (1204, 5000, ALONE_NOTE)
    assert status.state == "waiting" and ALONE_NOTE in status.line


def test_a_note_volunteers_must_not_see_is_malformed() -> None:
    frame = encode_message(sign_job_state(KEY, JobState(1, 2, "fine")))
    with pytest.raises(ProtocolError, match="U\\+001B"):
        parse_message(reframe(frame, note="\x1b]0;owned\x07"))
    with pytest.raises(ProtocolError, match="too long"):
        parse_message(reframe(frame, note="n" * 301))


def test_a_job_state_before_the_welcome_is_refused(tmp_path: Path) -> None:
    session = new_session(PinStore.in_dir(tmp_path))
    say_hello(session, KEY, 0.0)
    frame = encode_message(sign_job_state(KEY, JobState(1, 2, "")))
    assert only_error(session.receive(frame, 0.0).send).code == "unexpected_message"
    assert session.job_state is None


def test_signature_errors_name_a_signature() -> None:
    frame = reframe(encode_message(sign_job_state(KEY, JobState(1, 2, ""))), steps=3)
    with pytest.raises(SignatureError):
        verify_job_state(parse_message(frame), KEY.public_key())


# ---- what the coordinator says, by the run's state ------------------------------------


def record(step: int, tiles: int, workers: int) -> StepRecord:
    return StepRecord(
        step=step,
        loss=1.0,
        seconds=0.1,
        tiles=tiles,
        reissued=0,
        workers=workers,
        gemms_offloaded=1 if tiles else 0,
        gemms_local=0,
    )


def test_the_note_says_why_workers_get_no_tiles() -> None:
    seen: list[tuple[str, int, str]] = []
    progress = Progress(10, on_change=lambda p: seen.append((p.state, p.step, p.note())))
    assert progress.note() == STATE_NOTES[RunState.STARTING]
    progress.state = RunState.WAITING
    progress.state = RunState.TRAINING
    assert progress.note() == ""  # no step yet: nothing known to say
    progress.add(record(0, tiles=0, workers=2), 1.0, None)
    assert progress.note() == ALONE_NOTE
    progress.add(record(1, tiles=1, workers=2), 1.0, None)
    assert progress.note() == FEW_TILES_NOTE
    progress.add(record(2, tiles=12, workers=2), 1.0, None)
    assert progress.note() == "" and progress.status()["note"] == ""
    progress.state = RunState.DONE
    assert seen == [
        ("waiting for workers", 0, STATE_NOTES[RunState.WAITING]),
        ("training", 0, ""),
        ("training", 1, ALONE_NOTE),
        ("training", 2, FEW_TILES_NOTE),
        ("training", 3, ""),
        ("done", 3, STATE_NOTES[RunState.DONE]),
    ]


# ---- the operator's words ---------------------------------------------------------------


def test_the_operator_describes_the_job_on_the_command_line() -> None:
    from coordinator.cli import parse_args
    from coordinator.jobs.tiny_gpt import make_job
    from coordinator.serve_options import ServeOptions

    job = make_job()
    own = ServeOptions.from_args(parse_args(["serve"])).about(job)
    assert own.name == "tiny_gpt" and "Shakespeare" in own.description
    assert own.parameters == sum(p.numel() for p in job.model.parameters())
    argv = ["serve", "--job-name", "sonnets", "--job-operator", "Lab 7"]
    told = ServeOptions.from_args(parse_args([*argv, "--job-link", "https://lab7.example"]))
    about = told.about(job)
    assert (about.name, about.operator, about.link) == ("sonnets", "Lab 7", "https://lab7.example")
    assert about.description == own.description  # not given: the job's own
    bad = ServeOptions.from_args(parse_args(["serve", "--job-link", "file:///etc/passwd"]))
    with pytest.raises(SystemExit, match="http:// or https://.*--job-link"):
        bad.about(job)
