"""The front door of a job with several coordinator ranks, without sockets: which rank
a joining worker should serve (coordinator.pool.front_door), the signed welcome that
sends it there (admission), and the worker session that follows it only to a URL
pinned to the same key (client_app.session)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.hellos import hello_frame
from support.worker_sessions import URL, new_session, say_hello, welcome_frame

from client_app.config import PinStore
from common.auth import answer_challenge, check_welcome, new_nonce
from common.errors import ProtocolError
from common.limits import DEFAULT_LIMITS
from common.messages import Hello, Welcome, encode_message, parse_message, wire_header
from common.signing import generate_private_key
from coordinator.pool.admission import Admission, Admitted, SentOn
from coordinator.pool.core import CoordinatorCore
from coordinator.pool.front_door import FRESH_S, Direction, FrontDoor, RankLoad
from coordinator.pool.ledger import Ledger

OTHER = "ws://10.0.0.2:8766/ws"


def load(rank: int, workers: int, at: float = 100.0, state: str = "training") -> RankLoad:
    return RankLoad(rank, f"ws://10.0.0.{rank + 1}:{8765 + rank}/ws", workers, state, at)


# ---- the decision ------------------------------------------------------------------------


def test_a_worker_goes_to_the_rank_with_the_fewest_workers_and_ties_stay() -> None:
    door = FrontDoor(rank=0)
    others = [load(1, 3), load(2, 1)]
    assert door.direct(my_workers=1, others=others, now=101.0) is None  # 1 vs 1: stay
    got = door.direct(my_workers=2, others=others, now=101.0)
    assert got == Direction(2, "ws://10.0.0.3:8767/ws")


def test_workers_sent_since_a_rank_last_spoke_count_as_its_own() -> None:
    door = FrontDoor(rank=0)
    others = [load(1, 0, at=100.0)]
    # A burst of joins at rank 0 while rank 1's summary still says 0 workers: they are
    # shared, not all sent to rank 1.
    mine, sent = 1, []
    for _ in range(6):
        direction = door.direct(my_workers=mine, others=others, now=101.0)
        sent.append(direction is not None)
        mine += direction is None
    assert sent == [True, False, True, False, True, False] and mine == 4
    # Rank 1 speaks again, counting the 3 it received: they are no longer added.
    assert door.direct(my_workers=4, others=[load(1, 3, at=102.0)], now=102.5) is not None


def test_nobody_goes_to_a_rank_that_is_silent_stopping_or_not_reachable() -> None:
    door = FrontDoor(rank=0)
    assert door.direct(10, [load(1, 0, at=100.0)], now=100.0 + FRESH_S + 1) is None
    assert door.direct(10, [load(1, 0, state="stopping")], now=101.0) is None
    assert door.direct(10, [RankLoad(1, "", 0, "training", 100.0)], now=101.0) is None
    assert door.direct(10, [load(0, 0)], now=101.0) is None  # itself


# ---- the welcome that sends a worker on --------------------------------------------------


@pytest.fixture
def core(tmp_path: Path) -> CoordinatorCore:
    return CoordinatorCore(key=generate_private_key(), ledger=Ledger(tmp_path / "l.sqlite"))


def test_the_front_door_sends_a_worker_on_in_its_signed_welcome(core: CoordinatorCore) -> None:
    asked: list[Hello] = []

    def front_door(hello: Hello) -> Direction:
        asked.append(hello)
        return Direction(1, OTHER)

    a = Admission(core.key, core, "job", 2.0, 1 << 20, rank=0, ranks=2, front_door=front_door)
    frame = hello_frame(a, name="alice")
    verdict = a.answer(frame)
    assert isinstance(verdict, SentOn) and OTHER in verdict.reason
    received = parse_message(verdict.welcome)
    welcome = received.message
    assert isinstance(welcome, Welcome)
    assert (welcome.serve_at, welcome.rank, welcome.ranks) == (OTHER, 0, 2)
    hello = parse_message(frame).message
    check_welcome(welcome, received.frame.header, a.challenge, hello)  # type: ignore[arg-type]
    assert [h.name for h in asked] == ["alice"] and core.workers == {}


def test_a_worker_that_was_sent_here_is_never_sent_on_again(core: CoordinatorCore) -> None:
    def front_door(hello: Hello) -> Direction:
        raise AssertionError("a directed worker must not be asked about")

    a = Admission(core.key, core, "job", 2.0, 1 << 20, rank=1, ranks=2, front_door=front_door)
    hello = parse_message(hello_frame(a)).message
    assert isinstance(hello, Hello)
    directed = answer_challenge(
        a.challenge,
        key=generate_private_key(),
        nonce=new_nonce(),
        name="bob",
        profile=hello.profile,
        window=1,
        client="test",
        directed=True,
    )
    verdict = a.answer(encode_message(directed))
    assert isinstance(verdict, Admitted) and verdict.hello.directed
    welcome = parse_message(verdict.welcome).message
    assert isinstance(welcome, Welcome) and (welcome.rank, welcome.ranks) == (1, 2)
    assert welcome.serve_at == ""


@pytest.mark.parametrize(
    "url",
    ["http://x/ws", "javascript:alert(1)", "ws://a b/ws", "ws://x/\u202e", "ws://" + "a" * 600],
)
def test_a_welcome_may_send_a_worker_only_to_a_websocket_url(url: str) -> None:
    header = wire_header(Welcome("w", "00" * 32, 1.0, 1 << 20, "job", serve_at="ws://ok/ws"))
    header["serve_at"] = url
    with pytest.raises(ProtocolError):
        Welcome.from_header(header, DEFAULT_LIMITS)


def test_a_welcome_names_a_rank_below_the_number_of_ranks() -> None:
    header = wire_header(Welcome("w", "00" * 32, 1.0, 1 << 20, "job", rank=1, ranks=2))
    assert Welcome.from_header(header, DEFAULT_LIMITS).rank == 1
    header["rank"] = 2
    with pytest.raises(ProtocolError):
        Welcome.from_header(header, DEFAULT_LIMITS)


# ---- the worker that follows it ----------------------------------------------------------


def test_the_worker_follows_a_signed_welcome_and_pins_the_rank_to_the_same_key(
    tmp_path: Path,
) -> None:
    pins = PinStore.in_dir(tmp_path)
    key = generate_private_key()
    session = new_session(pins)
    hello = say_hello(session, key, 0.0)
    actions = session.receive(welcome_frame(key, hello, rank=0, ranks=2, serve_at=OTHER), 0.0)
    assert actions.move_to == OTHER and actions.close and not actions.refusal
    assert actions.welcome is None  # not welcomed here: no tiles, no heartbeats
    assert pins.get(URL) == pins.get(OTHER) is not None  # the same key, pinned for both

    # At the other rank the hello says it was sent, and a welcome from the same key is
    # taken, with the rank it names.
    session.url, session.directed = OTHER, True
    again = say_hello(session, key, 1.0)
    assert isinstance(again.message, Hello) and again.message.directed
    taken = session.receive(welcome_frame(key, again, rank=1, ranks=2), 1.0)
    assert taken.welcome is not None and (session.rank, session.ranks) == (1, 2)


def test_the_worker_refuses_to_be_sent_to_a_url_pinned_to_another_key(tmp_path: Path) -> None:
    pins = PinStore.in_dir(tmp_path)
    pins.check(OTHER, generate_private_key().public_key().public_bytes_raw().hex())
    key = generate_private_key()
    session = new_session(pins)
    hello = say_hello(session, key, 0.0)
    actions = session.receive(welcome_frame(key, hello, rank=0, ranks=2, serve_at=OTHER), 0.0)
    assert actions.refusal and not actions.move_to
