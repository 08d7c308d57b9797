"""Worker sessions joined to a coordinator the test plays by hand: the frames each side
sends."""

from __future__ import annotations

from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client_app.config import PinStore
from client_app.session import Actions, Phase, WorkerSession
from common.auth import check_hello, make_welcome
from common.messages import (
    Challenge,
    DeviceProfile,
    Error,
    Hello,
    Message,
    Received,
    encode_message,
    encode_task,
    parse_message,
)
from common.signing import generate_private_key, public_key_hex

URL = "ws://127.0.0.1:9/ws"


PROFILE = DeviceProfile(
    device="cpu",
    device_name="test cpu",
    threads=1,
    ram_bytes=1 << 33,
    mem_cap_bytes=1 << 20,
    gflops=10.0,
)


HEARTBEAT_S = 5.0


WORKER_KEY = generate_private_key()


NONCES = iter(f"{i:064x}" for i in range(1 << 30))


def new_session(pins: PinStore, **kwargs: object) -> WorkerSession:
    options: dict[str, object] = dict(
        name="w", identity=WORKER_KEY, profile=PROFILE, pin_check=pins.check
    )
    options.update(kwargs)
    return WorkerSession(URL, nonce_source=lambda: next(NONCES), **options)  # type: ignore[arg-type]


def challenge_frame(key: Ed25519PrivateKey, token_required: bool = False) -> bytes:
    return encode_message(Challenge(next(NONCES), public_key_hex(key), token_required))


def say_hello(session: WorkerSession, key: Ed25519PrivateKey, now: float) -> Received:
    """Connect and answer the coordinator's challenge: the hello as the coordinator reads it."""
    session.connect(now)
    challenge = challenge_frame(key)
    actions = session.receive(challenge, now)
    assert session.phase is Phase.HELLO_SENT and len(actions.send) == 1
    received = parse_message(actions.send[0])
    hello = received.message
    assert isinstance(hello, Hello)
    check = parse_message(challenge).message
    assert isinstance(check, Challenge)
    check_hello(hello, received.frame.header, check)  # the proof verifies
    return received


def welcome_frame(
    key: Ed25519PrivateKey, hello: Received, max_frame_bytes: int = 1 << 26, **ranks: Any
) -> bytes:
    """The signed welcome for ``hello`` (``ranks``: make_welcome's rank, ranks, serve_at)."""
    assert isinstance(hello.message, Hello)
    return encode_message(
        make_welcome(
            key,
            hello.message,
            worker_id="w-7",
            heartbeat_interval_s=HEARTBEAT_S,
            max_frame_bytes=max_frame_bytes,
            job="test",
            **ranks,
        )
    )


def join(
    session: WorkerSession,
    key: Ed25519PrivateKey,
    now: float = 0.0,
    max_frame_bytes: int = 1 << 26,
) -> Actions:
    """Connect, answer the challenge and take the welcome; the welcome's actions."""
    hello = say_hello(session, key, now)
    return session.receive(welcome_frame(key, hello, max_frame_bytes), now)


def decode(frame: bytes) -> Message:
    return parse_message(frame).message


def welcomed(pins: PinStore, key: Ed25519PrivateKey, now: float = 0.0) -> WorkerSession:
    session = new_session(pins)
    actions = join(session, key, now)
    assert actions.welcome is not None and not actions.refusal
    return session


def task(
    key: Ed25519PrivateKey,
    tile_id: str = "t-1",
    shape: tuple[int, int, int] = (4, 6, 3),
    dtype: torch.dtype = torch.float32,
) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    m, k, n = shape
    gen = torch.Generator().manual_seed(hash(tile_id) % 1000)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    return encode_task(tile_id, "mm", a, b, key), a, b


def only_error(frames: tuple[bytes, ...]) -> Error:
    assert len(frames) == 1
    msg = decode(frames[0])
    assert isinstance(msg, Error), msg
    return msg
