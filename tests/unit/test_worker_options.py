"""``WorkerOptions``: validated when made; ``WorkerCore`` takes them (and field overrides)."""

from __future__ import annotations

import random
import ssl
from pathlib import Path

import pytest

from client_app.config import PinStore, WorkerSettings
from client_app.options import WorkerOptions, tls_context
from client_app.worker import WorkerCore
from common.signing import generate_private_key

URL = "ws://127.0.0.1:1/ws"


@pytest.mark.parametrize(
    "bad",
    [
        {"client_name": ""},
        {"max_frame_bytes": 0},
        {"welcome_timeout_s": 0.0},
        {"backoff_base_s": -1.0},
        {"backoff_cap_s": 0.0},
        {"summary_every": 0},
        {"summary_min_interval_s": -0.5},
    ],
)
def test_bad_options_are_refused_when_made(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        WorkerOptions(**bad)  # type: ignore[arg-type]


def test_the_url_decides_whether_tls_and_a_ca_file_apply(tmp_path: Path) -> None:
    assert tls_context(URL, None) is None
    assert isinstance(tls_context("wss://example.org/ws", None), ssl.SSLContext)
    with pytest.raises(ValueError, match="ws:// or wss://"):
        tls_context("http://example.org/ws", None)
    with pytest.raises(ValueError, match="only to wss://"):
        tls_context(URL, "ca.pem")
    with pytest.raises(ValueError, match="cannot load CA file"):
        tls_context("wss://example.org/ws", str(tmp_path / "missing.pem"))


def test_the_core_takes_its_options_and_they_are_checked(tmp_path: Path) -> None:
    settings = WorkerSettings(coordinator_url=URL, threads=1, use_gpu=False)
    pins = PinStore.in_dir(tmp_path).check
    key, rng = generate_private_key(), random.Random(3)
    core = WorkerCore(settings, pin_check=pins, options=WorkerOptions(identity=key, rng=rng))
    assert core.identity is key and core.options.rng is rng
    assert core.options.client_name == "cleave-worker"  # the rest are the defaults
    assert WorkerCore(settings, pin_check=pins).identity is not key  # a fresh identity
    with pytest.raises(ValueError, match="backoff_base_s"):
        WorkerOptions(backoff_base_s=0.0)
    with pytest.raises(ValueError, match="ws:// or wss://"):
        WorkerCore(WorkerSettings(coordinator_url="tcp://x:1"), pin_check=pins)
