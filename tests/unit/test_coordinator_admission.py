"""The handshake's decisions without sockets (coordinator.pool.admission): each first
frame a client might send, and the verdict the coordinator gives it."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
from support.hellos import hello_frame

from common import PROTOCOL_VERSION
from common.auth import check_welcome
from common.frames import encode_frame
from common.messages import Error, Heartbeat, Welcome, encode_message, parse_message
from common.signing import generate_private_key, public_key_hex
from coordinator.pool.admission import Admission, Admitted, Refusal
from coordinator.pool.core import CoordinatorCore
from coordinator.pool.effects import CloseCode
from coordinator.pool.ledger import Ledger


@pytest.fixture
def core(tmp_path: Path) -> CoordinatorCore:
    return CoordinatorCore(key=generate_private_key(), ledger=Ledger(tmp_path / "l.sqlite"))


def admission(core: CoordinatorCore, token: str = "") -> Admission:
    return Admission(core.key, core, "job", 2.0, 1 << 20, join_token=token)


def error_code(verdict: Refusal) -> str | None:
    if verdict.reply is None:
        return None
    error = parse_message(verdict.reply).message
    assert isinstance(error, Error)
    return error.code


def test_a_signed_hello_is_admitted_with_a_welcome_it_can_verify(core: CoordinatorCore) -> None:
    a = admission(core)
    frame = hello_frame(a, name="alice")
    verdict = a.answer(frame)
    assert isinstance(verdict, Admitted) and verdict.hello.name == "alice"
    received = parse_message(verdict.welcome)
    welcome = received.message
    assert isinstance(welcome, Welcome) and welcome.worker_id == verdict.worker_id
    assert welcome.job == "job" and welcome.heartbeat_interval_s == 2.0
    hello = parse_message(frame).message
    check_welcome(welcome, received.frame.header, a.challenge, hello)  # type: ignore[arg-type]
    assert core.workers == {}  # admitted to the core only once the welcome is out


@pytest.mark.parametrize(
    ("first", "error"),
    [
        ("hello, I am text", None),
        (random.Random(3).randbytes(4096), "limit_exceeded"),
        (encode_message(Heartbeat(1, "idle", 0))[:10], "bad_frame"),
        (encode_message(Heartbeat(1, "idle", 0)), "unexpected_message"),
        (encode_frame({"type": "\u00e9" * 64, "v": PROTOCOL_VERSION}), "unknown_type"),
    ],
    ids=["text", "garbage", "truncated", "heartbeat", "non-ascii type"],
)
def test_a_bad_first_frame_is_refused_for_policy(
    core: CoordinatorCore, first: str | bytes, error: str | None
) -> None:
    verdict = admission(core).answer(first)
    assert isinstance(verdict, Refusal) and verdict.code is CloseCode.POLICY
    assert error_code(verdict) == error


def test_a_hello_claiming_another_key_is_refused(core: CoordinatorCore) -> None:
    a = admission(core)
    forged = parse_message(hello_frame(a)).message
    victim = public_key_hex(generate_private_key())
    verdict = a.answer(encode_message(replace(forged, worker_key=victim)))  # type: ignore[type-var]
    assert isinstance(verdict, Refusal) and error_code(verdict) == "auth_failed"


def test_a_hello_recorded_for_another_challenge_is_refused(core: CoordinatorCore) -> None:
    victim = generate_private_key()
    recorded = hello_frame(admission(core), key=victim)
    verdict = admission(core).answer(recorded)  # a fresh nonce the recording cannot answer
    assert isinstance(verdict, Refusal) and error_code(verdict) == "auth_failed"


@pytest.mark.parametrize("token", ["", "wrong-secret"])
def test_a_private_pool_refuses_a_hello_without_its_token(
    core: CoordinatorCore, token: str
) -> None:
    a = admission(core, token="pool-secret")
    assert a.challenge.token_required
    verdict = a.answer(hello_frame(a, token=token))
    assert isinstance(verdict, Refusal) and error_code(verdict) == "bad_token"
    member = admission(core, token="pool-secret")
    assert isinstance(member.answer(hello_frame(member, token="pool-secret")), Admitted)


def test_a_banned_key_is_refused_with_the_reason(core: CoordinatorCore) -> None:
    key = generate_private_key()
    core.ledger.reject(public_key_hex(key), name="x", reputation=0.1, banned_reason="cheat", now=1)
    a = admission(core)
    verdict = a.answer(hello_frame(a, key=key))
    assert isinstance(verdict, Refusal) and error_code(verdict) == "banned"
    assert "cheat" in verdict.reason
