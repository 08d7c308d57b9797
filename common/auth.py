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
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.errors import AuthError, ErrorCode
from common.frames import canonical_json
from common.job_about import JobAbout
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


def _key_bytes(key_hex: str) -> bytes:
    public_key_from_hex(key_hex)  # raises SignatureError (a ProtocolError) if unusable
    return bytes.fromhex(key_hex)


def _proof_message(
    domain: bytes, header: dict[str, Any], nonce: str, whose_nonce: str, bound_key_hex: str
) -> bytes:
    """What a handshake signature covers: the domain, the peer's nonce, the key the proof
    is bound to, and the message's own header (without its signature)."""
    unsigned = {k: v for k, v in header.items() if k != SIGNATURE_FIELD}
    try:
        body = canonical_json(unsigned)
    except (ValueError, RecursionError):
        raise AuthError(f"{header.get('type')} header cannot be canonicalised") from None
    return domain + _nonce_bytes(nonce, whose_nonce) + _key_bytes(bound_key_hex) + body


def _sign_proof(
    key: Ed25519PrivateKey,
    domain: bytes,
    header: dict[str, Any],
    nonce: str,
    whose_nonce: str,
    bound_key_hex: str,
) -> str:
    return key.sign(_proof_message(domain, header, nonce, whose_nonce, bound_key_hex)).hex()


def _check_proof(
    signer_key_hex: str,
    domain: bytes,
    header: dict[str, Any],
    nonce: str,
    whose_nonce: str,
    bound_key_hex: str,
) -> None:
    """Raise AuthError unless ``header["sig"]`` is ``signer_key_hex``'s proof."""
    what = str(header.get("type"))
    message = _proof_message(domain, header, nonce, whose_nonce, bound_key_hex)
    sig = header.get(SIGNATURE_FIELD)
    if not isinstance(sig, str) or len(sig) != SIGNATURE_HEX_LEN:
        raise AuthError(f"{what} has no well-formed signature")
    try:
        public_key_from_hex(signer_key_hex).verify(bytes.fromhex(sig), message)
    except (ValueError, InvalidSignature):
        raise AuthError(f"{what} signature does not verify") from None


def token_proof(token: str, challenge_nonce: str, worker_key_hex: str) -> str:
    """What a worker sends instead of the join token: the token never travels."""
    message = _nonce_bytes(challenge_nonce, "challenge") + _key_bytes(worker_key_hex)
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
    cache_bytes: int = 0,
    directed: bool = False,
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
        cache_bytes=cache_bytes,
        directed=directed,
    )
    sig = _sign_proof(
        key,
        HELLO_DOMAIN,
        wire_header(hello),
        challenge.nonce,
        "challenge",
        challenge.coordinator_key,
    )
    return replace(hello, sig=sig)


class TokenRefused(AuthError):
    """The pool is private and the hello proved no (or the wrong) join token."""

    code = ErrorCode.BAD_TOKEN


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
    _check_proof(
        hello.worker_key,
        HELLO_DOMAIN,
        header,
        challenge.nonce,
        "challenge",
        challenge.coordinator_key,
    )
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
    about: JobAbout | None = None,
    rank: int = 0,
    ranks: int = 0,
    serve_at: str = "",
) -> Welcome:
    welcome = Welcome(
        worker_id=worker_id,
        coordinator_key=public_key_hex(key),
        heartbeat_interval_s=heartbeat_interval_s,
        max_frame_bytes=max_frame_bytes,
        job=job,
        about=about,
        rank=rank,
        ranks=ranks,
        serve_at=serve_at,
    )
    sig = _sign_proof(
        key, WELCOME_DOMAIN, wire_header(welcome), hello.nonce, "worker", hello.worker_key
    )
    return replace(welcome, sig=sig)


def check_welcome(
    welcome: Welcome, header: dict[str, Any], challenge: Challenge, hello: Hello
) -> None:
    """Raise AuthError unless the welcome comes from the key that sent the challenge and
    answers this hello's nonce."""
    if welcome.coordinator_key != challenge.coordinator_key:
        raise AuthError("welcome names another coordinator key than the challenge did")
    _check_proof(
        welcome.coordinator_key, WELCOME_DOMAIN, header, hello.nonce, "worker", hello.worker_key
    )
