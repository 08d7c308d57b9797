"""Shared test set-up: offscreen Qt, no test ever touches the user's real config, and
every test belongs to one tier (a marker, set here from the folder its file is in):

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

TIERS = ("unit", "loopback", "gui", "e2e")


def _tier(item: pytest.Item) -> str:
    """The folder's tier; a test marked e2e in another folder (the app's window drawn by
    a process of its own) is e2e."""
    if item.get_closest_marker("e2e") is not None:
        return "e2e"
    folder = Path(str(item.fspath)).parent.name
    if folder not in TIERS:
        raise pytest.UsageError(
            f"{item.fspath}: a test file belongs in tests/{{{','.join(TIERS)}}}/"
        )
    return folder


def pytest_sessionstart(session: pytest.Session) -> None:
    # The result check's compiled loops (coordinator.tiles.row_products), compiled and
    # cached once before any test: every coordinator, this process's or a test's own,
    # then loads them in under a second instead of compiling them on its start.
    from coordinator.tiles import row_products

    row_products.kernels()


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
                f"a unit test called socket.{method}: keep it off the network, or move its "
                "file to tests/loopback/"
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
