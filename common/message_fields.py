"""Reading a message's header fields, each naming the message and field in its error, and
the header a message travels with."""

from __future__ import annotations

from typing import Any

from common import PROTOCOL_VERSION
from common.errors import (
    ProtocolError,
)
from common.limits import WireLimits


def required(h: dict[str, Any], key: str, kind: type | tuple[type, ...], msg: str) -> Any:
    value = h.get(key)
    numeric = kind in (int, float, (int, float))
    if not isinstance(value, kind) or (isinstance(value, bool) and numeric):
        raise ProtocolError(f'{msg}: field "{key}" is missing or not {kind_name(kind)}')
    return value


def kind_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def text(h: dict[str, Any], key: str, msg: str, limits: WireLimits, *, max_chars: int = 0) -> str:
    value = required(h, key, str, msg)
    if len(value) > (max_chars or limits.max_string_chars):
        raise ProtocolError(f'{msg}: field "{key}" is too long')
    return str(value)


def integer(h: dict[str, Any], key: str, msg: str, *, lo: int = 0, hi: int = 1 << 62) -> int:
    value = required(h, key, int, msg)
    if not lo <= value <= hi:
        raise ProtocolError(f'{msg}: field "{key}"={value} outside [{lo}, {hi}]')
    return int(value)


def number(h: dict[str, Any], key: str, msg: str, *, lo: float = 0.0, hi: float = 1e18) -> float:
    value = required(h, key, (int, float), msg)
    if not lo <= value <= hi:
        raise ProtocolError(f'{msg}: field "{key}"={value} outside [{lo}, {hi}]')
    return float(value)


def obj(h: dict[str, Any], key: str, msg: str) -> dict[str, Any]:
    value = h.get(key, {})
    if not isinstance(value, dict):
        raise ProtocolError(f'{msg}: field "{key}" must be an object')
    return value


def wire_header(msg: Any) -> dict[str, Any]:
    """The header ``msg`` (any message) travels with, before any tensors: what handshakes
    and job states sign."""
    return {"type": msg.TYPE, "v": PROTOCOL_VERSION, **msg.to_header()}
