"""The sans-I/O worker session: every protocol decision, tested without sockets."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support.worker_sessions import (
    HEARTBEAT_S,
    NONCES,
    PROFILE,
    URL,
    WORKER_KEY,
    challenge_frame,
    decode,
    join,
    new_session,
    only_error,
    say_hello,
    task,
    welcome_frame,
    welcomed,
)

from client_app.config import PinStore
from client_app.session import Actions, Phase, WorkerSession
from client_app.session_types import TileJob
from common import PROTOCOL_VERSION
from common.auth import check_hello, make_welcome
from common.batches import batch_frame
from common.errors import ProtocolError
from common.frames import decode_frame, encode_frame
from common.messages import (
    Ack,
    Bye,
    Cancel,
    Challenge,
    Error,
    Heartbeat,
    Hello,
    Pause,
    Result,
    Resume,
    encode_message,
    encode_task,
    parse_message,
)
from common.signing import fingerprint, generate_private_key, public_key_hex
from common.task_messages import task_frame
from common.tensors import content_id, encode_block

# ---- joining --------------------------------------------------------------------------


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return generate_private_key()


@pytest.fixture
def pins(tmp_path: Path) -> PinStore:
    return PinStore.in_dir(tmp_path)


def test_challenge_is_answered_with_a_signed_hello(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = new_session(pins, window=3)
    assert session.connect(0.0) is None  # the coordinator speaks first
    assert session.phase is Phase.CONNECTED
    hello = say_hello(new_session(pins, window=3), key, 0.0).message
    assert isinstance(hello, Hello)
    assert (hello.name, hello.profile, hello.window) == ("w", PROFILE, 3)
    assert hello.worker_key == public_key_hex(WORKER_KEY) and hello.token_proof == ""


def test_private_pool_without_a_token_is_refused_for_good(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = new_session(pins)
    session.connect(0.0)
    actions = session.receive(challenge_frame(key, token_required=True), 0.0)
    assert "join token" in actions.refusal and actions.send == ()
    assert session.phase is Phase.REFUSED


def test_token_is_proven_not_sent(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = new_session(pins, token="s3cret-pool")
    session.connect(0.0)
    challenge = challenge_frame(key, token_required=True)
    frame = session.receive(challenge, 0.0).send[0]
    assert b"s3cret-pool" not in frame
    received = parse_message(frame)
    hello, asked = received.message, parse_message(challenge).message
    assert isinstance(hello, Hello) and isinstance(asked, Challenge)
    check_hello(hello, received.frame.header, asked, join_token="s3cret-pool")
    with pytest.raises(ProtocolError) as wrong:
        check_hello(hello, received.frame.header, asked, join_token="another-token")
    assert wrong.value.code == "bad_token"


@pytest.mark.parametrize("code", ["banned", "bad_token"])
def test_ban_or_bad_token_stops_the_worker(
    pins: PinStore, key: Ed25519PrivateKey, code: str
) -> None:
    session = new_session(pins)
    say_hello(session, key, 0.0)
    actions = session.receive(encode_message(Error(code, "you are out")), 0.0)
    assert "you are out" in actions.refusal and session.phase is Phase.REFUSED


def test_welcome_signed_by_another_key_closes_the_connection(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = new_session(pins)
    hello = say_hello(session, key, 0.0)
    impostor = generate_private_key()
    assert isinstance(hello.message, Hello)
    forged = make_welcome(
        impostor,
        hello.message,
        worker_id="w",
        heartbeat_interval_s=1.0,
        max_frame_bytes=1 << 20,
        job="j",
    )
    # It claims the challenger's key but can only sign with its own.
    forged = replace(forged, coordinator_key=public_key_hex(key))
    actions = session.receive(encode_message(forged), 0.0)
    assert actions.close and not actions.refusal and actions.welcome is None
    assert only_error(actions.send).code == "auth_failed"
    assert pins.get(URL) is None and session.phase is Phase.HELLO_SENT


def test_welcome_for_another_hello_is_refused(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = new_session(pins)
    old_hello = say_hello(session, key, 0.0)
    session.connection_lost()
    say_hello(session, key, 1.0)  # a new connection: a new nonce
    replayed = session.receive(welcome_frame(key, old_hello), 1.0)
    assert replayed.close and replayed.welcome is None


def test_first_welcome_pins_the_key_and_the_next_one_matches(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = new_session(pins)
    first = join(session, key, 0.0)
    assert first.welcome is not None and first.first_pin and first.send == ()
    assert pins.get(URL) == public_key_hex(key)
    assert session.phase is Phase.READY and session.worker_id == "w-7"
    assert session.fingerprint == fingerprint(key)
    session.connection_lost()
    again = join(session, key, 1.0)
    assert again.welcome is not None and not again.first_pin and not again.refusal


def test_changed_key_is_refused_for_good(
    pins: PinStore, key: Ed25519PrivateKey, caplog: pytest.LogCaptureFixture
) -> None:
    pins.check(URL, public_key_hex(generate_private_key()))  # pinned at an earlier join
    session = new_session(pins)
    actions = join(session, key, 0.0)
    assert "coordinator key changed" in actions.refusal
    assert f"cleave-worker --forget {URL}" in actions.refusal
    assert actions.welcome is None
    bye = decode(actions.send[0])
    assert isinstance(bye, Bye) and "key changed" in bye.reason
    assert session.phase is Phase.REFUSED
    assert "coordinator key changed" in caplog.text
    # Nothing is computed for it, and the session will not join again.
    frame, _, _ = task(key)
    assert session.receive(frame, 0.1).compute == ()
    assert session.next_tile() is None and session.heartbeat(100.0) is None
    with pytest.raises(RuntimeError):
        session.connect(1.0)


def test_unusable_key_closes_the_connection(pins: PinStore) -> None:
    session = new_session(pins)
    session.connect(0.0)
    bad = encode_message(Challenge(next(NONCES), "zz" * 32))
    actions = session.receive(bad, 0.0)
    assert actions.close and not actions.refusal
    assert only_error(actions.send).code == "bad_signature"
    assert pins.get(URL) is None  # nothing unusable is ever pinned


# ---- tasks ----------------------------------------------------------------------------


def test_good_task_is_queued_computed_and_answered(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    frame, a, b = task(key, "t-1")
    actions = session.receive(frame, 1.0)
    assert actions.compute == ("t-1",) and actions.send == ()
    assert session.in_flight == 1
    job = session.next_tile()
    assert job is not None and job.tile_id == "t-1" and job.op == "mm"
    assert torch.equal(job.a, a) and torch.equal(job.b, b)
    assert job.flop == 2 * 4 * 6 * 3
    assert session.current_tile == "t-1"
    result_frame = session.tile_finished(job, job.a @ job.b, 0.25)
    assert result_frame is not None
    received = parse_message(result_frame)
    assert received.message == Result(
        tile_id="t-1", compute_s=0.25, tensors=received.frame.header["tensors"]
    )
    torch.testing.assert_close(received.tensors()["c"], a @ b, rtol=0, atol=0)
    assert session.stats.tiles_done == 1 and session.in_flight == 0 and session.current_tile == ""


def test_tiles_are_computed_one_at_a_time_in_arrival_order(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = welcomed(pins, key)
    for tile_id in ("t-1", "t-2", "t-3"):
        session.receive(task(key, tile_id)[0], 1.0)
    first = session.next_tile()
    assert first is not None and first.tile_id == "t-1"
    assert session.next_tile() is None  # one compute thread: t-1 must finish first
    session.tile_finished(first, first.a @ first.b, 0.1)
    order = []
    while (job := session.next_tile()) is not None:
        order.append(job.tile_id)
        session.tile_finished(job, job.a @ job.b, 0.1)
    assert order == ["t-2", "t-3"]


def two_on_the_compute_thread(
    pins: PinStore, key: Ed25519PrivateKey
) -> tuple[WorkerSession, TileJob, TileJob]:
    """A session holding t-1, t-2 and t-3, the first two taken for the compute thread."""
    session = welcomed(pins, key)
    for tile_id in ("t-1", "t-2", "t-3"):
        session.receive(task(key, tile_id)[0], 1.0)
    first, second = session.next_tile(2), session.next_tile(2)
    assert first is not None and second is not None
    return session, first, second


def test_two_tiles_may_be_on_the_compute_thread_and_are_booked_in_order(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session, first, second = two_on_the_compute_thread(pins, key)
    assert (first.tile_id, second.tile_id) == ("t-1", "t-2")
    assert session.next_tile(2) is None  # two on the compute thread already
    assert session.in_flight == 3 and session.current_tile == "t-1"
    assert session.wanted(first) and session.wanted(second)
    assert session.tile_done(first, 0.1) is not None
    assert session.current_tile == "t-2"
    third = session.next_tile(2)
    assert third is not None and third.tile_id == "t-3"
    assert session.tile_done(second, 0.1) is not None
    assert session.tile_done(third, 0.1) is not None
    assert session.stats.tiles_done == 3 and session.in_flight == 0


def test_a_tile_cancelled_behind_the_computing_one_is_not_wanted(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session, first, second = two_on_the_compute_thread(pins, key)
    assert session.receive(encode_message(Cancel("t-2")), 1.1).cancel == ("t-2",)
    assert session.wanted(first) and not session.wanted(second)
    assert session.holds("t-1") and not session.holds("t-2") and session.holds("t-3")
    assert session.in_flight == 2
    # Its slot on the compute thread is taken until it is booked (skipped or done).
    assert session.next_tile(2) is None
    assert session.tile_done(second, 0.0) is None
    assert session.tile_done(first, 0.1) is not None
    assert session.stats.tiles_cancelled == 1 and session.stats.tiles_done == 1
    # A pause drops what is left, on the compute thread too.
    third = session.next_tile(2)
    assert third is not None
    assert set(session.pause("on battery").cancel) == {"t-3"}
    assert not session.wanted(third) and session.tile_done(third, 0.0) is None
    assert session.stats.tiles_cancelled == 2


def flip_payload_byte(frame: bytes) -> bytes:
    parsed = decode_frame(frame)
    payload = bytearray(parsed.payload)
    payload[len(payload) // 2] ^= 0x01
    return encode_frame(dict(parsed.header), [bytes(payload)])


def break_descriptor_unsigned(frame: bytes) -> bytes:
    # Makes the operands undecodable *without* re-signing: must be refused on the
    # signature, which proves the signature is checked before any operand is decoded.
    parsed = decode_frame(frame)
    header = dict(parsed.header)
    header["tensors"] = [dict(d, nbytes=d["nbytes"] + 4) for d in header["tensors"]]
    return encode_frame(header, [bytes(parsed.payload)])


@pytest.mark.parametrize("tamper", ["payload_byte", "foreign_key", "descriptor"])
def test_badly_signed_task_is_refused_with_an_error_and_never_computed(
    pins: PinStore, key: Ed25519PrivateKey, caplog: pytest.LogCaptureFixture, tamper: str
) -> None:
    session = welcomed(pins, key)
    good, a, b = task(key, "t-3")
    if tamper == "payload_byte":
        frame = flip_payload_byte(good)
    elif tamper == "descriptor":
        frame = break_descriptor_unsigned(good)
    else:
        frame = encode_task("t-3", "mm", a, b, generate_private_key())
    with caplog.at_level(logging.WARNING, logger="client_app.session"):
        actions = session.receive(frame, 1.0)
    error = only_error(actions.send)
    assert (error.code, error.tile_id) == ("bad_signature", "t-3")
    assert "tampered in transit" in error.message
    assert actions.compute == () and session.next_tile() is None and session.in_flight == 0
    assert session.stats.tiles_refused == 1
    assert "refused tile t-3: bad_signature:" in caplog.text
    # The session keeps going: the next good tile is computed.
    assert session.receive(task(key, "t-4")[0], 2.0).compute == ("t-4",)


def test_signed_task_with_bad_operands_is_refused(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    frame = encode_task("t-5", "mm", torch.ones(2, 3), torch.ones(4, 5), key)
    actions = session.receive(frame, 1.0)
    error = only_error(actions.send)
    assert (error.code, error.tile_id) == ("bad_tensor", "t-5")
    assert session.next_tile() is None


def test_task_with_an_op_off_the_whitelist_is_refused(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = welcomed(pins, key)
    parsed = decode_frame(task(key, "t-6")[0])
    frame = encode_frame(dict(parsed.header, op="exec"), [bytes(parsed.payload)])
    error = only_error(session.receive(frame, 1.0).send)
    assert (error.code, error.tile_id) == ("bad_op", "t-6")
    assert session.stats.tiles_refused == 1


def test_task_before_welcome_is_refused(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = new_session(pins)
    say_hello(session, key, 0.0)
    actions = session.receive(task(key, "t-0")[0], 0.0)
    error = only_error(actions.send)
    assert (error.code, error.tile_id) == ("unexpected_message", "t-0")
    assert actions.compute == ()


def test_tile_over_the_memory_cap_is_refused(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)  # PROFILE caps tiles at 1 MiB
    frame, _, _ = task(key, "big", shape=(256, 256, 512))  # 256 KiB + 512 KiB + 512 KiB
    error = only_error(session.receive(frame, 1.0).send)
    assert (error.code, error.tile_id) == ("limit_exceeded", "big")
    assert "mem_cap_bytes=1048576" in error.message


def test_result_that_would_not_fit_the_coordinators_frames_is_refused(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = new_session(pins)
    join(session, key, 0.0, max_frame_bytes=8192)
    error = only_error(session.receive(task(key, "t-9", shape=(64, 8, 64))[0], 1.0).send)
    assert error.code == "limit_exceeded" and "max_frame_bytes=8192" in error.message


def test_duplicate_and_excess_tiles_are_refused(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = new_session(pins, max_held_tiles=2)
    join(session, key, 0.0)
    assert session.receive(task(key, "t-1")[0], 1.0).compute == ("t-1",)
    assert only_error(session.receive(task(key, "t-1")[0], 1.0).send).code == "duplicate_tile"
    assert session.receive(task(key, "t-2")[0], 1.0).compute == ("t-2",)
    assert only_error(session.receive(task(key, "t-3")[0], 1.0).send).code == "limit_exceeded"


# ---- cancel, failures, reconnects -----------------------------------------------------


def test_cancel_drops_a_queued_tile(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    session.receive(task(key, "t-1")[0], 1.0)
    session.receive(task(key, "t-2")[0], 1.0)
    actions = session.receive(encode_message(Cancel("t-2")), 1.5)
    assert actions.cancel == ("t-2",) and actions.send == ()
    job = session.next_tile()
    assert job is not None and job.tile_id == "t-1"
    assert session.tile_finished(job, job.a @ job.b, 0.1) is not None
    assert session.next_tile() is None


def test_cancel_of_the_computing_tile_discards_its_result(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = welcomed(pins, key)
    session.receive(task(key, "t-1")[0], 1.0)
    job = session.next_tile()
    assert job is not None
    assert session.receive(encode_message(Cancel("t-1")), 1.1).cancel == ("t-1",)
    assert session.in_flight == 0
    assert session.tile_finished(job, job.a @ job.b, 0.1) is None
    assert session.stats.tiles_done == 0 and session.stats.tiles_cancelled == 1


def test_cancel_of_an_unknown_tile_is_harmless(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    assert session.receive(encode_message(Cancel("gone")), 1.0).send == ()


def test_lost_connection_forgets_its_tiles(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    session.receive(task(key, "t-1")[0], 1.0)
    session.receive(task(key, "t-2")[0], 1.0)
    computing = session.next_tile()
    assert computing is not None
    session.connection_lost()
    assert session.in_flight == 0 and session.phase is Phase.DISCONNECTED
    join(session, key, 2.0)
    # The old connection's result has nowhere to go: the coordinator re-issues the tile.
    assert session.tile_finished(computing, computing.a @ computing.b, 0.1) is None
    assert session.next_tile() is None


def test_failed_computation_is_reported_as_an_error(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    session.receive(task(key, "t-1")[0], 1.0)
    job = session.next_tile()
    assert job is not None
    frame = session.tile_failed(job, RuntimeError("CUDA out of memory"))
    assert frame is not None
    error = decode(frame)
    assert isinstance(error, Error) and error.code == "compute_failed" and error.tile_id == "t-1"
    assert "out of memory" in error.message
    assert session.next_tile() is None


# ---- other messages -------------------------------------------------------------------


def test_unknown_message_type_gets_an_error_reply(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    frame = encode_frame({"type": "launch_missiles", "v": PROTOCOL_VERSION, "tile_id": "x"})
    error = only_error(session.receive(frame, 1.0).send)
    assert error.code == "unknown_type" and "launch_missiles" in error.message
    assert error.tile_id == "x"
    assert session.phase is Phase.READY  # keeps going


@pytest.mark.parametrize(
    ("data", "code"),
    [
        ("a text frame", "bad_message"),
        (b"\x00\x00", "bad_frame"),
        (b"\x00\x00\x00\x05{nope", "bad_frame"),
        (encode_frame({"type": "ack", "v": PROTOCOL_VERSION + 1}), "version"),
        (encode_frame({"type": "ack", "v": PROTOCOL_VERSION, "seq": "x"}), "bad_message"),
    ],
)
def test_malformed_frames_get_an_error_reply(
    pins: PinStore, key: Ed25519PrivateKey, data: bytes | str, code: str
) -> None:
    session = welcomed(pins, key)
    assert only_error(session.receive(data, 1.0).send).code == code
    assert session.receive(task(key, "t-1")[0], 2.0).compute == ("t-1",)


def test_messages_for_coordinators_get_an_error_reply(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = welcomed(pins, key)
    for msg in (Hello("x", PROFILE, 1), Heartbeat(1, "idle", 0), Pause("x"), Resume()):
        assert only_error(session.receive(encode_message(msg), 1.0).send).code == (
            "unexpected_message"
        )


def test_coordinator_errors_are_logged_not_answered(
    pins: PinStore, key: Ed25519PrivateKey, caplog: pytest.LogCaptureFixture
) -> None:
    session = welcomed(pins, key)
    actions = session.receive(encode_message(Error("overloaded", "slow down", "t-1")), 1.0)
    assert actions == Actions()  # nothing to send, compute or close
    assert "overloaded: slow down (tile t-1)" in caplog.text
    # A malformed *error* is not answered either: two peers must not trade errors forever.
    bad_error = encode_frame({"type": "error", "v": PROTOCOL_VERSION, "code": 5})
    assert session.receive(bad_error, 1.0).send == ()


def test_ack_records_credit(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    session.receive(encode_message(Ack(seq=1, credit_tiles=12, credit_gflop=3.5)), 1.0)
    assert (session.stats.credit_tiles, session.stats.credit_gflop) == (12, 3.5)


def test_coordinator_bye_closes_the_connection(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    actions = session.receive(encode_message(Bye("restarting")), 1.0)
    assert "restarting" in actions.close and not actions.refusal


# ---- heartbeats, pause, bye -----------------------------------------------------------


def test_heartbeats_are_due_every_interval_and_carry_state(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = new_session(pins)
    hello = say_hello(session, key, 0.0)
    assert session.heartbeat(100.0) is None  # not welcomed yet
    session.receive(welcome_frame(key, hello), 10.0)
    assert session.next_heartbeat_at == 10.0 + HEARTBEAT_S
    assert session.heartbeat(14.9) is None
    first = session.heartbeat(15.0)
    assert first is not None and decode(first) == Heartbeat(seq=1, state="idle", in_flight=0)
    session.receive(task(key, "t-1")[0], 15.5)
    assert session.heartbeat(19.0) is None
    second = session.heartbeat(20.0)
    assert second is not None
    assert decode(second) == Heartbeat(seq=2, state="working", in_flight=1)


def test_pause_drops_tiles_refuses_new_ones_and_resume_undoes_it(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = welcomed(pins, key)
    session.receive(task(key, "t-1")[0], 1.0)
    session.receive(task(key, "t-2")[0], 1.0)
    job = session.next_tile()
    assert job is not None
    actions = session.pause("on battery")
    assert decode(actions.send[0]) == Pause("on battery")
    assert set(actions.cancel) == {"t-1", "t-2"}
    assert only_error(session.receive(task(key, "t-3")[0], 2.0).send).code == "paused"
    beat = session.heartbeat(100.0)
    assert beat is not None
    assert decode(beat) == Heartbeat(seq=1, state="paused", in_flight=0, reason="on battery")
    assert decode(session.resume().send[0]) == Resume()
    assert session.receive(task(key, "t-4")[0], 3.0).compute == ("t-4",)
    # t-1 is still computing (its result will be dropped), yet the coordinator may
    # already have handed it back: that is a new assignment, not a duplicate.
    assert session.receive(task(key, "t-1")[0], 3.0).compute == ("t-1",)
    assert session.tile_finished(job, job.a @ job.b, 0.1) is None
    following = session.next_tile()
    assert following is not None and following.tile_id == "t-4"


def test_bye_leaves_for_good(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    session.receive(task(key, "t-1")[0], 1.0)
    frame = session.bye("worker stopping")
    assert frame is not None and decode(frame) == Bye("worker stopping")
    assert session.phase is Phase.CLOSED and session.in_flight == 0
    assert session.bye("again") is None
    assert session.receive(task(key, "t-2")[0], 2.0).compute == ()


def test_bytes_in_and_out_are_counted(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = new_session(pins)
    session.connect(0.0)
    challenge = challenge_frame(key)
    hello = session.receive(challenge, 0.0).send[0]
    welcome = welcome_frame(key, parse_message(hello))
    session.receive(welcome, 0.0)
    frame, _, _ = task(key)
    session.receive(frame, 1.0)
    job = session.next_tile()
    assert job is not None
    result = session.tile_finished(job, job.a @ job.b, 0.1)
    assert result is not None
    assert session.stats.bytes_in == len(challenge) + len(welcome) + len(frame)
    assert session.stats.bytes_out == len(hello) + len(result)


def test_bf16_and_bmm_tiles_round_trip(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    a = torch.randn(3, 4, 5).to(torch.bfloat16)
    b = torch.randn(3, 5, 2).to(torch.bfloat16)
    session.receive(encode_task("t-b", "bmm", a, b, key), 1.0)
    job = session.next_tile()
    assert job is not None and job.op == "bmm" and job.a.dtype == torch.bfloat16
    assert job.flop == 2 * 3 * 4 * 5 * 2
    result = session.tile_finished(job, torch.bmm(job.a, job.b), 0.1)
    assert result is not None
    c = parse_message(result).tensors()["c"]
    torch.testing.assert_close(c, torch.bmm(a, b), rtol=0, atol=0)


# ---- operand cache ----------------------------------------------------------------------


def cached_session(pins: PinStore, key: Ed25519PrivateKey, cache_bytes: int) -> WorkerSession:
    session = new_session(pins, cache_bytes=cache_bytes)
    actions = join(session, key, 0.0)
    assert actions.welcome is not None
    return session


def block_task(
    key: Ed25519PrivateKey,
    tile_id: str,
    a: torch.Tensor,
    b: torch.Tensor,
    refs: frozenset[str] = frozenset(),
    ids: tuple[str | None, str | None] | None = None,
) -> bytes:
    """A task with operands under their content ids (``ids``: others, for references)."""
    known = ids or (content_id(a), content_id(b))
    return bytes(encode_task(tile_id, "mm", a, b, key, ids=known, refs=refs))


def test_operands_sent_under_a_block_id_are_kept_and_referred_to_later(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = cached_session(pins, key, cache_bytes=1 << 20)
    a, b0, b1 = torch.randn(8, 6), torch.randn(6, 4), torch.randn(6, 4)
    first = block_task(key, "t-0", a, b0)
    assert session.receive(first, 1.0).compute == ("t-0",)
    assert session.cached_blocks == 2
    # The next tile of the same row block: A by reference only (a smaller frame).
    second = block_task(key, "t-1", a, b1, refs=frozenset({"a"}))
    assert len(second) < len(first)
    assert session.receive(second, 1.0).compute == ("t-1",)
    first_job = session.next_tile()
    assert first_job is not None and first_job.tile_id == "t-0"
    assert session.tile_finished(first_job, first_job.a @ first_job.b, 0.1) is not None
    job = session.next_tile()
    assert job is not None and job.tile_id == "t-1"
    assert torch.equal(job.a, a) and torch.equal(job.b, b1)


def test_a_reference_to_a_block_not_held_asks_for_the_tile_again(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = cached_session(pins, key, cache_bytes=1 << 20)
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    session.receive(block_task(key, "t-0", a, b), 1.0)
    assert session.cached_blocks == 2
    never_sent = "f" * 64
    ref = block_task(key, "t-1", a, b, refs=frozenset({"a"}), ids=(never_sent, None))
    actions = session.receive(ref, 1.0)
    error = only_error(actions.send)
    assert (error.code, error.tile_id) == ("missing_block", "t-1") and actions.compute == ()
    # Both sides start over: the coordinator empties its mirror and resends whole.
    assert session.cached_blocks == 0 and session.stats.tiles_refused == 0


def test_the_cache_keeps_to_its_budget_least_recently_used_first(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    block_bytes = 8 * 6 * 4  # one [8, 6] fp32 operand
    session = cached_session(pins, key, cache_bytes=3 * block_bytes)
    b = torch.randn(6, 8)
    a = [torch.randn(8, 6) for _ in range(3)]
    for i in range(3):  # a0 b, a1 b, a2 b: b is touched every time, a0 is the oldest
        session.receive(block_task(key, f"t-{i}", a[i], b), 1.0)
        job = session.next_tile()
        assert job is not None
        session.tile_done(job, 0.0)
    held = list(session._blocks)  # noqa: SLF001
    # a0 went first; b, used every time, stays
    assert held == [content_id(a[1]), content_id(a[2]), content_id(b)]
    none = cached_session(pins, key, cache_bytes=0)
    none.receive(block_task(key, "t-0", torch.randn(8, 6), b), 1.0)
    assert none.cached_blocks == 0


# ---- batches ---------------------------------------------------------------------------


def test_a_batch_is_taken_frame_by_frame_in_order(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    tampered = flip_payload_byte(task(key, "t-2")[0])
    batch = batch_frame(
        [task(key, "t-1")[0], tampered, task(key, "t-3")[0], encode_message(Cancel("t-3"))]
    )
    bytes_before = session.stats.bytes_in
    actions = session.receive(batch, 1.0)
    # Each task on its own signature: the tampered one alone is refused.
    assert actions.compute == ("t-1", "t-3") and actions.cancel == ("t-3",)
    error = only_error(actions.send)
    assert (error.code, error.tile_id) == ("bad_signature", "t-2")
    assert session.stats.bytes_in - bytes_before == len(batch)
    job = session.next_tile()
    assert job is not None and job.tile_id == "t-1"
    session.tile_finished(job, job.a @ job.b, 0.1)
    assert session.next_tile() is None


def test_a_batch_stops_at_a_frame_that_closes_the_connection(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = welcomed(pins, key)
    batch = batch_frame([task(key, "t-1")[0], encode_message(Bye("restart")), task(key, "t-2")[0]])
    actions = session.receive(batch, 1.0)
    assert actions.compute == ("t-1",) and "restart" in actions.close
    assert session.in_flight == 1


def test_a_batch_inside_a_batch_gets_an_error_reply(pins: PinStore, key: Ed25519PrivateKey) -> None:
    session = welcomed(pins, key)
    nested = batch_frame([task(key, "t-1")[0], task(key, "t-2")[0]])
    actions = session.receive(batch_frame([nested, task(key, "t-3")[0]]), 1.0)
    assert only_error(actions.send).code == "bad_message"
    assert actions.compute == ("t-3",) and session.in_flight == 1


def test_small_tasks_under_their_batchs_signature_are_computed_and_a_forged_one_refused(
    pins: PinStore, key: Ed25519PrivateKey
) -> None:
    session = welcomed(pins, key)
    a, b = encode_block(torch.randn(4, 6)), encode_block(torch.randn(6, 3))
    batch = batch_frame([task_frame(f"t-{i}", "mm", a, b, key, lazy=True) for i in (1, 2, 3)])
    assert session.receive(batch, 1.0).compute == ("t-1", "t-2", "t-3")
    # Another tile id in a vouched header: not the task the batch's signature covers.
    forged = batch_frame([task_frame(f"t-{i}", "mm", a, b, key, lazy=True) for i in (4, 5)])
    actions = session.receive(forged.replace(b'"tile_id":"t-4"', b'"tile_id":"t-6"'), 2.0)
    error = only_error(actions.send)
    assert (error.code, error.tile_id) == ("bad_signature", "t-6")
    assert actions.compute == ("t-5",)
