"""``cleave-worker`` arguments, exit codes, ``--forget``, and the no-Qt rule for the core."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import sys
from pathlib import Path

import pytest
from test_worker_loopback import FakeCoordinator, within

from client_app import cli
from client_app.config import PinStore
from common.signing import generate_private_key, public_key_hex

pytestmark = pytest.mark.timeout(60)

URL = "ws://127.0.0.1:1/ws"
PACKAGE = Path(cli.__file__).resolve().parent


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "config"
    monkeypatch.setenv("CLEAVE_CONFIG_DIR", str(directory))
    return directory


def test_forget_removes_a_pin_and_exits(config: Path) -> None:
    pins = PinStore.in_dir(config)
    pins.check(URL, "aa" * 32)
    pins.check("ws://keep:1/ws", "bb" * 32)
    assert cli.main(["--forget", URL]) == cli.EXIT_OK
    assert pins.load() == {"ws://keep:1/ws": "bb" * 32}
    assert cli.main(["--forget", URL]) == cli.EXIT_OK  # nothing to forget is not an error


@pytest.mark.parametrize(
    "argv",
    [
        ["--coordinator", URL, "--threads", "0"],
        ["--coordinator", URL, "--window", "65"],
        ["--coordinator", URL, "--memory-mb", "-5"],
        ["--coordinator", URL, "--log-level", "LOUD"],
        ["--coordinator", "http://127.0.0.1:1/ws"],
        ["--coordinator", URL, "--name", "x" * 65],
        [],  # no coordinator given and none saved
    ],
)
def test_bad_arguments_exit_with_usage_error(config: Path, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == cli.EXIT_USAGE


def test_corrupt_pin_file_stops_the_worker_before_it_joins(config: Path) -> None:
    config.mkdir(parents=True)
    (config / "known_coordinators.json").write_text("[1, 2")
    assert cli.main(["--coordinator", URL]) == cli.EXIT_USAGE


async def test_changed_key_exits_with_code_3_and_generates_a_persistent_name(config: Path) -> None:
    env = dict(os.environ, CLEAVE_CONFIG_DIR=str(config))
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent), env.get("PYTHONPATH", "")])

    async with FakeCoordinator() as coord:
        PinStore.in_dir(config).check(coord.url, public_key_hex(generate_private_key()))
        # A real process, so that a worker which wrongly keeps going can be killed.
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "client_app",
            "--coordinator",
            coord.url,
            "--threads",
            "1",
            "--no-gpu",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert proc.stdout is not None
        try:
            hello_name = (await coord.next_link(timeout=30)).hello.name
            code = await within(proc.wait(), 30)
            output = (await within(proc.stdout.read())).decode(errors="replace")
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    assert code == cli.EXIT_REFUSED, output
    assert "coordinator key changed" in output and "--forget" in output
    saved = json.loads((config / "settings.json").read_text())
    assert saved["name"] == hello_name and re.fullmatch(r".+-[0-9a-f]{4}", hello_name)
    assert saved["coordinator_url"] == ""  # flags are not written back, only the name


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_core_never_imports_qt() -> None:
    """napari's rule: the GUI sits on a Qt-free core (only client_app/gui may use Qt)."""
    core_files = [p for p in PACKAGE.rglob("*.py") if "gui" not in p.relative_to(PACKAGE).parts]
    assert len(core_files) >= 9
    qt = {"PySide6", "PyQt5", "PyQt6", "PySide2", "qtpy"}
    for path in core_files:
        assert not (_imported_modules(path) & qt), f"{path} imports Qt"
