"""``cleave-worker`` arguments, exit codes, ``--forget``, the in-use and temperature
flags, and the no-Qt rule for the core."""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import os
import re
import sys
from pathlib import Path

import pytest
from support.fake_coordinator import FakeCoordinator, within

from client_app import cli
from client_app.config import PinStore, WorkerSettings
from client_app.readings import Sampler
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


def test_in_use_and_temperature_flags_override_saved_settings() -> None:
    saved = WorkerSettings(
        in_use_cpu_percent=50, in_use_threads=3, max_cpu_temp_c=90.0, max_gpu_temp_c=85.0
    )
    args = cli.build_parser().parse_args(
        [
            "--in-use-cpu-percent",
            "0",  # 0 is a value, not "unset"
            "--in-use-threads",
            "1",
            "--max-cpu-temp",
            "0",  # clears the saved limit
            "--max-gpu-temp",
            "80.5",
            "--temp-hysteresis",
            "3",
        ]
    )
    settings = cli._settings_from_args(args, saved)
    assert (settings.in_use_cpu_percent, settings.in_use_threads) == (0, 1)
    assert (settings.max_cpu_temp_c, settings.max_gpu_temp_c) == (0.0, 80.5)
    assert settings.temp_hysteresis_c == 3.0
    assert cli._settings_from_args(cli.build_parser().parse_args([]), saved) == saved


@pytest.mark.parametrize(
    "argv",
    [
        ["--in-use-cpu-percent", "101"],
        ["--in-use-cpu-percent", "-1"],
        ["--in-use-cpu-percent", "half"],
        ["--in-use-threads", "0"],
        ["--max-cpu-temp", "19"],
        ["--max-cpu-temp", "121"],
        ["--max-gpu-temp", "hot"],
        ["--temp-hysteresis", "0.5"],
        ["--temp-hysteresis", "31"],
    ],
)
def test_bad_in_use_and_temperature_flags_exit_with_usage_error(
    config: Path, argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--coordinator", URL, *argv])
    assert info.value.code == cli.EXIT_USAGE


def test_help_lists_the_in_use_and_temperature_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--in-use-cpu-percent",
        "--in-use-threads",
        "--max-cpu-temp",
        "--max-gpu-temp",
        "--temp-hysteresis",
    ):
        assert flag in out


def test_a_temperature_limit_without_a_sensor_warns_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    no_sensors = Sampler(cpu=lambda: 1.0, battery=lambda: None)
    limits = WorkerSettings(max_cpu_temp_c=85.0, max_gpu_temp_c=80.0, use_gpu=True)
    with caplog.at_level(logging.WARNING, logger="client_app.cli"):
        cli._warn_unusable_temperature_limits(limits, no_sensors, gpu_present=True)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "CPU temperature limit (85 °C) cannot apply" in warnings[0]
    assert "GPU temperature limit (80 °C) cannot apply" in warnings[1]
    assert "nvidia-ml-py" in warnings[1]
    caplog.clear()
    with_sensors = Sampler(
        cpu=lambda: 1.0, battery=lambda: None, cpu_temp=lambda: 50.0, gpu_temp=lambda: 50.0
    )
    cli._warn_unusable_temperature_limits(limits, with_sensors, gpu_present=True)
    cli._warn_unusable_temperature_limits(WorkerSettings(), no_sensors, gpu_present=False)
    cpu_only = WorkerSettings(max_gpu_temp_c=80.0, use_gpu=False)  # the GPU limit is moot
    cli._warn_unusable_temperature_limits(cpu_only, no_sensors, gpu_present=False)
    assert caplog.records == []


def test_describe_policy_names_the_in_use_and_temperature_limits() -> None:
    text = cli._describe_policy(
        WorkerSettings(
            threads=2, in_use_cpu_percent=30, in_use_threads=1, max_cpu_temp_c=85.0, use_gpu=False
        )
    )
    assert "while in use 30% of the time, 1 thread" in text
    assert "pause above 85 °C CPU (resume at 80 °C)" in text
    assert "paused while in use" in cli._describe_policy(WorkerSettings(in_use_cpu_percent=0))


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
