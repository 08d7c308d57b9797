"""Signed hello frames, as a worker sends them, for the handshake's tests."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.auth import answer_challenge, new_nonce
from common.messages import encode_message
from common.signing import generate_private_key
from coordinator.pool.admission import Admission
from support.memory_pool import PROFILE


def hello_frame(
    a: Admission, key: Ed25519PrivateKey | None = None, token: str = "", name: str = "w"
) -> bytes:
    hello = answer_challenge(
        a.challenge,
        key=key or generate_private_key(),
        nonce=new_nonce(),
        name=name,
        profile=PROFILE,
        window=1,
        client="test",
        token=token,
    )
    return encode_message(hello)
