"""The connect handshake's proofs (common.auth): what verifies, and everything that must not."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from common.auth import (
    NONCE_HEX_LEN,
    TokenRefused,
    answer_challenge,
    check_hello,
    check_welcome,
    make_welcome,
    new_nonce,
    token_proof,
)
from common.errors import AuthError, ProtocolError
from common.messages import Challenge, DeviceProfile, Hello, Welcome, encode_message, parse_message
from common.signing import generate_private_key, public_key_hex

COORDINATOR = generate_private_key()
WORKER = generate_private_key()
PROFILE = DeviceProfile("cpu", "test", 2, 1 << 30, 1 << 26, 12.5)


def challenge(token_required: bool = False) -> Challenge:
    return Challenge(new_nonce(), public_key_hex(COORDINATOR), token_required)


def hello_for(ch: Challenge, token: str = "", **overrides: Any) -> Hello:
    options: dict[str, Any] = dict(
        key=WORKER, nonce=new_nonce(), name="w", profile=PROFILE, window=2, client="t"
    )
    options.update(overrides)
    return answer_challenge(ch, token=token, **options)


def wire(msg: Hello | Welcome) -> tuple[Any, dict[str, Any]]:
    """The message and header exactly as the other side parses them."""
    received = parse_message(encode_message(msg))
    return received.message, received.frame.header


def test_nonces_are_fresh_hex() -> None:
    nonces = {new_nonce() for _ in range(100)}
    assert len(nonces) == 100 and all(len(n) == NONCE_HEX_LEN for n in nonces)
    int(nonces.pop(), 16)


def test_an_honest_handshake_verifies_both_ways() -> None:
    ch = challenge()
    hello, header = wire(hello_for(ch))
    check_hello(hello, header, ch)
    welcome = make_welcome(
        COORDINATOR, hello, worker_id="w1", heartbeat_interval_s=2.0, max_frame_bytes=1, job="j"
    )
    parsed, welcome_header = wire(welcome)
    check_welcome(parsed, welcome_header, ch, hello)


@pytest.mark.parametrize(
    "field, value",
    [
        ("name", "someone-else"),
        ("window", 9),
        ("worker_key", public_key_hex(generate_private_key())),
        ("nonce", "00" * 32),
        ("sig", "00" * 64),
    ],
)
def test_any_change_to_a_signed_hello_is_caught(field: str, value: Any) -> None:
    ch = challenge()
    hello, header = wire(replace(hello_for(ch), **{field: value}))
    with pytest.raises(AuthError):
        check_hello(hello, header, ch)


def test_a_hello_answers_one_challenge_of_one_coordinator() -> None:
    ch = challenge()
    hello, header = wire(hello_for(ch))
    with pytest.raises(AuthError):  # another connection's nonce: a replay
        check_hello(hello, header, replace(ch, nonce=new_nonce()))
    other = public_key_hex(generate_private_key())
    with pytest.raises(AuthError):  # relayed to another coordinator
        check_hello(hello, header, replace(ch, coordinator_key=other))


def test_malformed_proofs_raise_protocol_errors_only() -> None:
    ch = challenge()
    for bad in (
        {"nonce": "xyz"},
        {"nonce": "zz" * 32},
        {"worker_key": "not-a-key"},
        {"sig": ""},
        {"sig": "g" * 128},
    ):
        hello, header = wire(replace(hello_for(ch), **bad))
        with pytest.raises(ProtocolError):
            check_hello(hello, header, ch)


def test_join_token_is_proven_per_challenge_and_per_key() -> None:
    ch = challenge(token_required=True)
    hello, header = wire(hello_for(ch, token="t0k3n"))
    check_hello(hello, header, ch, join_token="t0k3n")
    assert "t0k3n" not in str(header)
    with pytest.raises(TokenRefused, match="wrong"):
        check_hello(hello, header, ch, join_token="other")
    bare, bare_header = wire(hello_for(ch))
    with pytest.raises(TokenRefused, match="no join token"):
        check_hello(bare, bare_header, ch, join_token="t0k3n")
    # The proof is bound to the nonce and the key: useless to copy.
    assert token_proof("t0k3n", ch.nonce, hello.worker_key) != token_proof(
        "t0k3n", new_nonce(), hello.worker_key
    )


def test_a_welcome_must_come_from_the_challenger_and_answer_this_hello() -> None:
    ch = challenge()
    hello, _ = wire(hello_for(ch))
    impostor = generate_private_key()
    forged = make_welcome(
        impostor, hello, worker_id="w", heartbeat_interval_s=1.0, max_frame_bytes=1, job="j"
    )
    parsed, header = wire(forged)
    with pytest.raises(AuthError, match="another coordinator key"):
        check_welcome(parsed, header, ch, hello)
    parsed, header = wire(replace(forged, coordinator_key=ch.coordinator_key))
    with pytest.raises(AuthError, match="does not verify"):
        check_welcome(parsed, header, ch, hello)
    genuine = make_welcome(
        COORDINATOR, hello, worker_id="w", heartbeat_interval_s=1.0, max_frame_bytes=1, job="j"
    )
    other_hello, _ = wire(hello_for(ch))  # same worker, another nonce
    parsed, header = wire(genuine)
    with pytest.raises(AuthError):
        check_welcome(parsed, header, ch, other_hello)
