"""Ed25519 keys, fingerprints and task-bundle signatures."""

from __future__ import annotations

import copy
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from common.errors import KeyMismatchError, ProtocolError, SignatureError
from common.frames import canonical_json, decode_frame
from common.messages import encode_task, parse_message, verify_task
from common.signing import (
    SIGNATURE_FIELD,
    TASK_DOMAIN,
    bundle_digest,
    fingerprint,
    generate_private_key,
    load_or_create_private_key,
    private_key_bytes,
    public_key_from_hex,
    public_key_hex,
    sign_bundle,
    signed_header_json,
    verify_bundle,
)

FIXED_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
FINGERPRINT_RE = re.compile(r"^[0-9a-f]{4}(-[0-9a-f]{4}){7}$")


@pytest.fixture(scope="module")
def key() -> Ed25519PrivateKey:
    return generate_private_key()


def _header() -> dict[str, Any]:
    return {
        "type": "task",
        "v": 1,
        "tile_id": "g3/t7",
        "op": "mm",
        "tensors": [
            {
                "name": "a",
                "dtype": "float32",
                "shape": [2, 4],
                "offset": 0,
                "nbytes": 32,
                "block": "a" * 64,
            },
            {
                "name": "b",
                "dtype": "float32",
                "shape": [4, 1],
                "offset": 64,
                "nbytes": 16,
                "block": "b" * 64,
            },
        ],
    }


def _signed(key: Ed25519PrivateKey) -> dict[str, Any]:
    header = _header()
    header[SIGNATURE_FIELD] = sign_bundle(key, header)
    return header


# ---- round trip ----------------------------------------------------------------------


def test_a_header_serialised_with_its_signature_appended_parses_and_verifies(
    key: Ed25519PrivateKey,
) -> None:
    body = signed_header_json(key, _header())
    parsed = json.loads(body)
    assert parsed == _signed(key)  # Ed25519 signatures are deterministic
    verify_bundle(key.public_key(), parsed)
    parsed["tile_id"] = "g3/t8"
    with pytest.raises(SignatureError):
        verify_bundle(key.public_key(), parsed)


def test_sign_verify_round_trip(key: Ed25519PrivateKey) -> None:
    header = _signed(key)
    assert re.fullmatch(r"[0-9a-f]{128}", header[SIGNATURE_FIELD])
    verify_bundle(key.public_key(), header)


def test_signature_ignores_header_key_order(key: Ed25519PrivateKey) -> None:
    header = _signed(key)
    reordered = dict(reversed(list(header.items())))
    verify_bundle(key.public_key(), reordered)


def test_digest_is_domain_separated() -> None:
    digest = bundle_digest(_header())
    assert digest == TASK_DOMAIN + canonical_json(_header())
    # the "sig" field never takes part in what is signed
    with_sig = {**_header(), SIGNATURE_FIELD: "00" * 64}
    assert bundle_digest(with_sig) == digest


# ---- tampering ------------------------------------------------------------------------


@pytest.mark.parametrize("eighth", range(8))
def test_a_tampered_operand_byte_is_refused(key: Ed25519PrivateKey, eighth: int) -> None:
    """The signature covers the header; the operands' content ids bind their bytes."""
    a, b = torch.arange(8.0).reshape(2, 4), torch.arange(4.0).reshape(4, 1)
    frame = bytearray(encode_task("g3/t7", "mm", a, b, key))
    verify_task(parse_message(bytes(frame)), key.public_key())
    payload = len(decode_frame(bytes(frame)).payload)
    descriptors = decode_frame(bytes(frame)).header["tensors"]
    # A byte of a's 32 or of b's 16 (the gap between them is alignment padding).
    where = [d["offset"] + i for d in descriptors for i in range(d["nbytes"])]
    frame[len(frame) - payload + where[eighth * len(where) // 8]] ^= 0x01
    with pytest.raises(SignatureError, match="content id"):
        verify_task(parse_message(bytes(frame)), key.public_key())


def _header_tamperings() -> list[tuple[str, Any]]:
    def set_(path: list[Any], value: Any) -> Any:
        def apply(h: dict[str, Any]) -> None:
            target: Any = h
            for step in path[:-1]:
                target = target[step]
            target[path[-1]] = value

        return apply

    def delete(name: str) -> Any:
        return lambda h: h.pop(name)

    return [
        ("type", set_(["type"], "result")),
        ("v", set_(["v"], 2)),
        ("tile_id", set_(["tile_id"], "g3/t8")),
        ("op", set_(["op"], "bmm")),
        ("a.offset", set_(["tensors", 0, "offset"], 64)),
        ("a.shape", set_(["tensors", 0, "shape"], [4, 2])),
        ("a.dtype", set_(["tensors", 0, "dtype"], "float16")),
        ("b.nbytes", set_(["tensors", 1, "nbytes"], 8)),
        ("b.name", set_(["tensors", 1, "name"], "c")),
        ("a.block", set_(["tensors", 0, "block"], "f" * 64)),
        ("extra field", set_(["extra"], 1)),
        ("v as float", set_(["v"], 1.0)),
        ("drop tile_id", delete("tile_id")),
        ("drop tensors", delete("tensors")),
    ]


@pytest.mark.parametrize(
    "label,tamper", _header_tamperings(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_tampered_header_field(key: Ed25519PrivateKey, label: str, tamper: Any) -> None:
    header = copy.deepcopy(_signed(key))
    tamper(header)
    with pytest.raises(SignatureError, match="does not verify"):
        verify_bundle(key.public_key(), header)


def test_missing_signature(key: Ed25519PrivateKey) -> None:
    header = _signed(key)
    del header[SIGNATURE_FIELD]
    with pytest.raises(SignatureError, match="no well-formed signature"):
        verify_bundle(key.public_key(), header)


@pytest.mark.parametrize(
    "sig",
    ["", "00" * 63, "00" * 65, None, 123, ["00" * 64], "zz" * 64, "é" * 128, "0" * 127],
)
def test_malformed_signature(key: Ed25519PrivateKey, sig: Any) -> None:
    header = _signed(key)
    header[SIGNATURE_FIELD] = sig
    with pytest.raises(SignatureError):
        verify_bundle(key.public_key(), header)


@pytest.mark.parametrize("position", [0, 1, 63, 64, 127])
def test_altered_signature_digit(key: Ed25519PrivateKey, position: int) -> None:
    header = _signed(key)
    sig = header[SIGNATURE_FIELD]
    flipped = "1" if sig[position] != "1" else "2"
    header[SIGNATURE_FIELD] = sig[:position] + flipped + sig[position + 1 :]
    with pytest.raises(SignatureError):
        verify_bundle(key.public_key(), header)


def test_signature_with_whitespace_does_not_verify(key: Ed25519PrivateKey) -> None:
    header = _signed(key)
    sig = header[SIGNATURE_FIELD]
    header[SIGNATURE_FIELD] = sig[:62] + "  " + sig[64:]  # still 128 chars; fromhex skips spaces
    with pytest.raises(SignatureError):
        verify_bundle(key.public_key(), header)


def test_other_key_is_refused(key: Ed25519PrivateKey) -> None:
    header = _signed(key)
    other = generate_private_key()
    with pytest.raises(SignatureError, match="pinned coordinator key"):
        verify_bundle(other.public_key(), header)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_uncanonicalisable_header_is_a_signature_error(
    key: Ed25519PrivateKey, value: float
) -> None:
    header = _signed(key)
    header["extra"] = value
    with pytest.raises(SignatureError):
        verify_bundle(key.public_key(), header)


def test_signature_error_is_a_protocol_error() -> None:
    assert issubclass(SignatureError, ProtocolError)
    assert SignatureError("x").code == "bad_signature"


# ---- keys, files and fingerprints ---------------------------------------------------------


def test_key_file_is_created_then_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "state" / "nested" / "coordinator.key"
    created = load_or_create_private_key(path)
    assert path.read_bytes() == private_key_bytes(created)
    assert len(path.read_bytes()) == 32
    assert not path.with_suffix(".tmp").exists()
    reloaded = load_or_create_private_key(path)
    assert public_key_hex(reloaded) == public_key_hex(created)
    # a reloaded key signs what the created key's public half verifies
    header = _header()
    header[SIGNATURE_FIELD] = sign_bundle(reloaded, header)
    verify_bundle(created.public_key(), header)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_key_file_is_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "k.key"
    old_umask = os.umask(0)  # even with a permissive umask
    try:
        load_or_create_private_key(path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_stale_world_readable_temp_file_does_not_leak_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "k.key"
    stale = path.with_suffix(".tmp")
    stale.write_bytes(b"junk from a crashed run")
    stale.chmod(0o644)
    load_or_create_private_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_bytes()) == 32


@pytest.mark.parametrize("content", [b"", b"\0" * 31, b"\0" * 33, b"not a key at all", b"\0" * 64])
def test_corrupt_key_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "k.key"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="32-byte"):
        load_or_create_private_key(path)
    assert path.read_bytes() == content  # never overwritten


def test_public_key_hex_round_trip(key: Ed25519PrivateKey) -> None:
    text = public_key_hex(key)
    assert re.fullmatch(r"[0-9a-f]{64}", text)
    assert public_key_hex(key.public_key()) == text
    assert public_key_hex(public_key_from_hex(text)) == text
    header = _signed(key)
    verify_bundle(public_key_from_hex(text), header)


@pytest.mark.parametrize(
    "junk", ["", "zz", "00" * 31, "00" * 33, "0" * 63, "g" * 64, None, 5, b"\0" * 32]
)
def test_public_key_from_hex_junk(junk: Any) -> None:
    with pytest.raises(SignatureError, match="not an Ed25519 public key"):
        public_key_from_hex(junk)


def test_fingerprint_format_is_stable() -> None:
    assert public_key_hex(FIXED_KEY) == (
        "03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"
    )
    expected = "5647-5aa7-5463-474c-0285-df5d-bf2b-cab7"
    assert fingerprint(FIXED_KEY) == expected
    assert fingerprint(FIXED_KEY.public_key()) == expected
    assert fingerprint(public_key_hex(FIXED_KEY)) == expected
    assert FINGERPRINT_RE.fullmatch(expected)


def test_fingerprints_differ_between_keys() -> None:
    prints = {fingerprint(generate_private_key()) for _ in range(20)}
    assert len(prints) == 20
    assert all(FINGERPRINT_RE.fullmatch(p) for p in prints)


def test_key_mismatch_error_names_both_keys() -> None:
    err = KeyMismatchError("wss://c.example/ws", "aaaa-bbbb", "cccc-dddd")
    text = str(err)
    assert "aaaa-bbbb" in text and "cccc-dddd" in text and "wss://c.example/ws" in text
    assert "--forget" in text
