"""Mutual authentication at connect: each side proves it holds its Ed25519 key.

The handshake is three messages (see ``common.messages``):

1. coordinator -> worker ``challenge``: a fresh random nonce and the coordinator's key.
2. worker -> coordinator ``hello``: the worker's public key and its own nonce, signed
   over the coordinator's nonce *and* the coordinator's key. The nonce makes the proof
   good for this connection only (a recorded hello cannot be replayed); binding the
   coordinator's key means a rogue coordinator cannot relay a worker's proof to the
   real one to borrow its identity and credit.
3. coordinator -> worker ``welcome``, signed over the worker's nonce and key: the worker
   learns that the peer holds the key it pinned before any task arrives.

A private pool's join token never crosses the wire: the hello carries
``HMAC-SHA256(token, coordinator nonce | worker key)``, useless to an eavesdropper
and to a replay.

Pure functions: nonces come from the caller (``new_nonce`` wraps ``secrets``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import replace
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from common.errors import AuthError
from common.frames import canonical_json
from common.messages import Challenge, DeviceProfile, Hello, Welcome, wire_header
from common.signing import SIGNATURE_FIELD, SIGNATURE_HEX_LEN, public_key_from_hex, public_key_hex

HELLO_DOMAIN = b"cleave/hello/v1\0"
WELCOME_DOMAIN = b"cleave/welcome/v1\0"
NONCE_BYTES = 32
NONCE_HEX_LEN = 2 * NONCE_BYTES
TOKEN_PROOF_HEX_LEN = 64


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _nonce_bytes(nonce: str, whose: str) -> bytes:
    if len(nonce) != NONCE_HEX_LEN:
        raise AuthError(f"{whose} nonce must be {NONCE_HEX_LEN} hex digits")
    try:
        return bytes.fromhex(nonce)
    except ValueError:
        raise AuthError(f"{whose} nonce is not hex") from None


def _key_bytes(key_hex: str, whose: str) -> bytes:
    public_key_from_hex(key_hex)  # raises SignatureError (a ProtocolError) if unusable
    return bytes.fromhex(key_hex)


def _signed_bytes(domain: bytes, nonce: bytes, key: bytes, header: dict[str, Any]) -> bytes:
    unsigned = {k: v for k, v in header.items() if k != SIGNATURE_FIELD}
    return domain + nonce + key + canonical_json(unsigned)


def _sign(key: Ed25519PrivateKey, message: bytes) -> str:
    return key.sign(message).hex()


def _verify(key: Ed25519PublicKey, sig: object, message: bytes, what: str) -> None:
    if not isinstance(sig, str) or len(sig) != SIGNATURE_HEX_LEN:
        raise AuthError(f"{what} has no well-formed signature")
    try:
        key.verify(bytes.fromhex(sig), message)
    except (ValueError, InvalidSignature):
        raise AuthError(f"{what} signature does not verify") from None


def sign_hello(
    worker_key: Ed25519PrivateKey,
    header: dict[str, Any],
    challenge_nonce: str,
    coordinator_key_hex: str,
) -> str:
    """The hello's signature: over the coordinator's nonce, its key and the hello itself."""
    message = _signed_bytes(
        HELLO_DOMAIN,
        _nonce_bytes(challenge_nonce, "challenge"),
        _key_bytes(coordinator_key_hex, "coordinator"),
        header,
    )
    return _sign(worker_key, message)


def verify_hello(
    header: dict[str, Any], worker_key_hex: str, challenge_nonce: str, coordinator_key_hex: str
) -> None:
    """Raise AuthError unless the hello was signed by ``worker_key_hex`` for this challenge."""
    try:
        message = _signed_bytes(
            HELLO_DOMAIN,
            _nonce_bytes(challenge_nonce, "challenge"),
            _key_bytes(coordinator_key_hex, "coordinator"),
            header,
        )
    except (ValueError, RecursionError):
        raise AuthError("hello header cannot be canonicalised for verification") from None
    _verify(public_key_from_hex(worker_key_hex), header.get(SIGNATURE_FIELD), message, "hello")


def sign_welcome(
    coordinator_key: Ed25519PrivateKey,
    header: dict[str, Any],
    client_nonce: str,
    worker_key_hex: str,
) -> str:
    message = _signed_bytes(
        WELCOME_DOMAIN,
        _nonce_bytes(client_nonce, "worker"),
        _key_bytes(worker_key_hex, "worker"),
        header,
    )
    return _sign(coordinator_key, message)


def verify_welcome(
    header: dict[str, Any], coordinator_key_hex: str, client_nonce: str, worker_key_hex: str
) -> None:
    """Raise AuthError unless the welcome answers this worker's nonce with that key."""
    try:
        message = _signed_bytes(
            WELCOME_DOMAIN,
            _nonce_bytes(client_nonce, "worker"),
            _key_bytes(worker_key_hex, "worker"),
            header,
        )
    except (ValueError, RecursionError):
        raise AuthError("welcome header cannot be canonicalised for verification") from None
    _verify(
        public_key_from_hex(coordinator_key_hex),
        header.get(SIGNATURE_FIELD),
        message,
        "welcome",
    )


def token_proof(token: str, challenge_nonce: str, worker_key_hex: str) -> str:
    """What a worker sends instead of the join token: the token never travels."""
    message = _nonce_bytes(challenge_nonce, "challenge") + _key_bytes(worker_key_hex, "worker")
    return hmac.new(token.encode("utf-8"), message, hashlib.sha256).hexdigest()


def token_proof_ok(proof: str, token: str, challenge_nonce: str, worker_key_hex: str) -> bool:
    expected = token_proof(token, challenge_nonce, worker_key_hex)
    return hmac.compare_digest(proof.encode("ascii", "replace"), expected.encode("ascii"))


# ---- the handshake messages, built and checked -------------------------------------


def answer_challenge(
    challenge: Challenge,
    *,
    key: Ed25519PrivateKey,
    nonce: str,
    name: str,
    profile: DeviceProfile,
    window: int,
    client: str,
    token: str = "",
) -> Hello:
    """The signed hello a worker sends back (``nonce``: the worker's own challenge)."""
    key_hex = public_key_hex(key)
    proof = token_proof(token, challenge.nonce, key_hex) if token else ""
    hello = Hello(
        name=name,
        profile=profile,
        window=window,
        client=client,
        worker_key=key_hex,
        nonce=nonce,
        token_proof=proof,
    )
    sig = sign_hello(key, wire_header(hello), challenge.nonce, challenge.coordinator_key)
    return replace(hello, sig=sig)


class TokenRefused(AuthError):
    """The pool is private and the hello proved no (or the wrong) join token."""

    code = "bad_token"


def check_hello(
    hello: Hello,
    header: dict[str, Any],
    challenge: Challenge,
    join_token: str = "",
) -> None:
    """Raise AuthError (or TokenRefused) unless ``hello`` answers ``challenge`` properly.

    ``header`` is the hello's header as received: the signature covers it byte for byte.
    """
    _nonce_bytes(hello.nonce, "worker")
    verify_hello(header, hello.worker_key, challenge.nonce, challenge.coordinator_key)
    if join_token and not token_proof_ok(
        hello.token_proof, join_token, challenge.nonce, hello.worker_key
    ):
        what = "a wrong" if hello.token_proof else "no"
        raise TokenRefused(
            f"this coordinator is a private pool and the worker gave {what} join token"
        )


def make_welcome(
    key: Ed25519PrivateKey,
    hello: Hello,
    *,
    worker_id: str,
    heartbeat_interval_s: float,
    max_frame_bytes: int,
    job: str,
) -> Welcome:
    welcome = Welcome(
        worker_id=worker_id,
        coordinator_key=public_key_hex(key),
        heartbeat_interval_s=heartbeat_interval_s,
        max_frame_bytes=max_frame_bytes,
        job=job,
    )
    sig = sign_welcome(key, wire_header(welcome), hello.nonce, hello.worker_key)
    return replace(welcome, sig=sig)


def check_welcome(
    welcome: Welcome, header: dict[str, Any], challenge: Challenge, hello: Hello
) -> None:
    """Raise AuthError unless the welcome comes from the key that sent the challenge and
    answers this hello's nonce."""
    if welcome.coordinator_key != challenge.coordinator_key:
        raise AuthError("welcome names another coordinator key than the challenge did")
    verify_welcome(header, welcome.coordinator_key, hello.nonce, hello.worker_key)
