"""Shared test set-up: offscreen Qt, no test ever touches the user's real config, and
every test belongs to one tier (a marker, set here from its file):

- ``unit``: one process, no network (enforced: opening an IP socket fails the test);
- ``loopback``: real sockets on 127.0.0.1 within the test's process;
- ``gui``: the Qt app, offscreen;
- ``e2e``: real coordinator and worker processes over loopback.

``make test-fast`` runs the unit tier; ``make test`` runs them all.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.procs import reap_all

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

GUI_FILES = {"test_gui_app.py", "test_gui_stats.py", "test_settings_dialog.py"}
LOOPBACK_FILES = {
    "test_bandwidth.py",
    "test_coordinator_ledger.py",  # the PostgreSQL store's server on 127.0.0.1
    "test_coordinator_server.py",
    "test_http_api.py",
    "test_load_smoke.py",
    "test_worker_cli.py",
    "test_worker_duty.py",
    "test_worker_loopback.py",
    "test_worker_policy_runner.py",
}


def _tier(item: pytest.Item) -> str:
    name = Path(str(item.fspath)).name
    if item.get_closest_marker("e2e") is not None or name.startswith("test_e2e_"):
        return "e2e"
    if name in GUI_FILES:
        return "gui"
    if name in LOOPBACK_FILES:
        return "loopback"
    return "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)


_REAL_SOCKET = {m: getattr(socket.socket, m) for m in ("connect", "connect_ex", "bind")}


def _off_the_network(method: str) -> Callable[..., object]:
    real = _REAL_SOCKET[method]

    def guard(self: socket.socket, *args: object) -> object:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(
                f"a unit test called socket.{method}: keep it off the network, or list its "
                "file in LOOPBACK_FILES (tests/conftest.py)"
            )
        return real(self, *args)

    return guard


@pytest.fixture(autouse=True)
def _unit_tests_open_no_network(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    if request.node.get_closest_marker("unit") is not None:
        for method in _REAL_SOCKET:
            monkeypatch.setattr(socket.socket, method, _off_the_network(method))
    yield


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("CLEAVE_CONFIG_DIR", str(tmp_path / "cleave-config"))
    yield


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test() -> Iterator[None]:
    yield
    reap_all()
