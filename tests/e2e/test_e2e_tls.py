"""TLS end to end: ``--tls-cert``/``--tls-key`` on the coordinator, ``wss://`` on workers,
with a self-signed certificate generated for 127.0.0.1 and localhost."""

from __future__ import annotations

import sqlite3
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.certs import self_signed
from support.procs import Coordinator, Worker, assert_losses_match, wait_until
from websockets.sync.client import connect as ws_connect

from coordinator import train_locally
from coordinator.jobs.tiny_gpt import make_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _ledger(state: Path) -> dict[str, int]:
    with sqlite3.connect(state / "ledger.sqlite") as db:
        return dict(db.execute("SELECT name, tiles FROM contributions").fetchall())


def test_local_worker_over_wss_matches_local_torch(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    coord = Coordinator(
        tmp_path,
        "--steps",
        "3",
        "--local-workers",
        "1",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
    )
    assert coord.url.startswith("wss://")
    assert coord.wait(150) == 0, coord.output()
    assert "https://127.0.0.1:" in coord.output()
    records = coord.steps()
    assert_losses_match([r["loss"] for r in records], train_locally(make_job(), 3))
    assert _ledger(coord.state).get("local-0", 0) > 0


def test_status_https_and_untrusted_or_plain_clients_are_refused(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    coord = Coordinator(
        tmp_path,
        "--steps",
        "3",
        "--min-workers",
        "1",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
    )
    untrusted: Worker | None = None
    trusted: Worker | None = None
    try:
        assert coord.url.startswith("wss://") and coord.http.startswith("https://")
        trust = ssl.create_default_context(cafile=str(cert))
        status = coord.status(trust)
        assert status["state"] == "waiting for workers", status

        # Without the certificate as a CA, https verification fails.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            coord.status(ssl.create_default_context())
        # Plain ws:// to the TLS port: no WebSocket handshake.
        with pytest.raises(Exception):  # noqa: B017 - the exact error depends on timing
            ws_connect(coord.url.replace("wss://", "ws://"), open_timeout=5).close()

        # A worker that does not trust the self-signed certificate never joins.
        untrusted = Worker(tmp_path, coord.url, "untrusted", "--backoff-base", "0.2")
        wait_until(
            lambda: "certificate verify failed" in untrusted.output().lower(),
            60,
            "the untrusted worker to log a verify failure",
        )
        assert untrusted.proc.poll() is None, untrusted.output()  # it keeps retrying
        assert coord.status(trust)["workers"] == []
        untrusted.stop()

        trusted = Worker(tmp_path, coord.url, "trusted", "--ca-file", str(cert))
        assert coord.wait(150) == 0, coord.output()
    finally:
        for worker in (untrusted, trusted):
            if worker is not None:
                worker.stop()
        coord.kill()
    records = coord.steps()
    assert_losses_match([r["loss"] for r in records], train_locally(make_job(), 3))
    ledger = _ledger(coord.state)
    assert ledger.get("trusted", 0) > 0 and "untrusted" not in ledger, ledger


def test_tls_cert_and_key_go_together(tmp_path: Path) -> None:
    from coordinator.cli import parse_args
    from coordinator.serve_options import ServeOptions

    def options(*tls: str) -> ServeOptions:
        return ServeOptions.from_args(parse_args(["serve", "--coordinator-gflops", "0", *tls]))

    cert, key = self_signed(tmp_path)
    assert options().tls_context() is None
    assert options("--tls-cert", str(cert), "--tls-key", str(key)).tls_context() is not None
    for half in (("--tls-cert", str(cert)), ("--tls-key", str(key))):
        with pytest.raises(SystemExit, match="give both or neither"):
            options(*half)
