"""Ed25519 keys and task-bundle signatures.

A bundle is signed over ``DOMAIN | canonical header without "sig"``. The header binds
the payload through each operand's content id (``common.tensors.content_id``: BLAKE3 of
its dtype, shape and bytes), which the worker recomputes before it uses an operand. So
the coordinator hashes each operand block once per GEMM, however many tiles share it,
and a task that refers to a cached block is re-signed without hashing anything.
The domain tag keeps a task signature from ever being valid as anything else.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from common.atomic_file import atomic_write_bytes
from common.errors import SignatureError
from common.frames import canonical_json

TASK_DOMAIN = b"cleave/task/v2\0"
# A batch of small tasks is signed once: over its header, which lists each task's digest.
BATCH_DOMAIN = b"cleave/batch/v1\0"
SIGNATURE_FIELD = "sig"
SIGNATURE_HEX_LEN = 128


def generate_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_key_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def public_key_hex(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def public_key_from_hex(text: str) -> Ed25519PublicKey:
    try:
        raw = bytes.fromhex(text)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"not an Ed25519 public key: {exc}") from None


def fingerprint(key: Ed25519PublicKey | Ed25519PrivateKey | str) -> str:
    """Short, human-comparable form of a public key, e.g. ``3f2a-91c0-...`` (16 bytes)."""
    hex_key = key if isinstance(key, str) else public_key_hex(key)
    digest = hashlib.sha256(bytes.fromhex(hex_key)).hexdigest()[:32]
    return "-".join(digest[i : i + 4] for i in range(0, 32, 4))


def load_or_create_private_key(path: Path) -> Ed25519PrivateKey:
    """Load a raw 32-byte key, or create one readable only by its owner."""
    if path.exists():
        raw = path.read_bytes()
        if len(raw) != 32:
            raise ValueError(f"{path} is not a 32-byte Ed25519 private key")
        return Ed25519PrivateKey.from_private_bytes(raw)
    key = generate_private_key()
    atomic_write_bytes(path, private_key_bytes(key))  # owner-only, never half-written
    return key


def bundle_digest(header: dict[str, Any], domain: bytes = TASK_DOMAIN) -> bytes:
    """What gets signed: the header without its signature, under the task domain."""
    unsigned = {k: v for k, v in header.items() if k != SIGNATURE_FIELD}
    return domain + canonical_json(unsigned)


def sign_bundle(key: Ed25519PrivateKey, header: dict[str, Any]) -> str:
    """Signature (hex) for a task header; the caller stores it under "sig"."""
    return key.sign(bundle_digest(header)).hex()


def signed_header_json(key: Ed25519PrivateKey, header: dict[str, Any]) -> bytes:
    """A task header (without "sig") as JSON with its signature added."""
    return signed_json(key, canonical_json(header))


def signed_json(key: Ed25519PrivateKey, unsigned: bytes, domain: bytes = TASK_DOMAIN) -> bytes:
    """Canonical JSON of a header with its signature added: the "sig" member is appended
    rather than the header serialised a second time (JSON's members are unordered; the
    receiver canonicalises what it parsed to verify)."""
    signature = key.sign(domain + unsigned).hex()
    return unsigned[:-1] + b',"' + SIGNATURE_FIELD.encode() + b'":"' + signature.encode() + b'"}'


def task_digest(unsigned: bytes) -> str:
    """What a signed batch says of a task it vouches for: BLAKE3 of the task's canonical
    header (without "sig") under the task domain."""
    return blake3.blake3(TASK_DOMAIN + unsigned).hexdigest()


def verify_bundle(
    key: Ed25519PublicKey, header: dict[str, Any], domain: bytes = TASK_DOMAIN
) -> None:
    """Raise SignatureError unless ``header["sig"]`` was made by ``key`` over this header
    (its operands are checked against their signed content ids afterwards)."""
    sig_hex = header.get(SIGNATURE_FIELD)
    if not isinstance(sig_hex, str) or len(sig_hex) != SIGNATURE_HEX_LEN:
        raise SignatureError("task bundle has no well-formed signature")
    try:
        signature = bytes.fromhex(sig_hex)
    except ValueError:
        raise SignatureError("task bundle signature is not hex") from None
    try:
        digest = bundle_digest(header, domain)
    except (ValueError, RecursionError):
        # NaN/inf or nesting too deep to re-serialise: it cannot be what was signed.
        raise SignatureError(
            "task bundle header cannot be canonicalised for verification"
        ) from None
    try:
        key.verify(signature, digest)
    except InvalidSignature:
        raise SignatureError(
            "task bundle signature does not verify against the pinned coordinator key "
            "(tampered in transit, or signed by another key)"
        ) from None
