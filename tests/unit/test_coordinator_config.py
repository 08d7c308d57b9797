"""``cleave-coordinator serve --config FILE``: TOML values under command-line flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from common.errors import ConfigError
from coordinator.cli import build_parser, parse_args, subcommand_parser
from coordinator.config_file import config_values

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "packaging" / "server" / "coordinator.toml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "coordinator.toml"
    path.write_text(text)
    return path


def _serve_parser() -> argparse.ArgumentParser:
    return subcommand_parser(build_parser(), "serve")


def test_file_values_apply_and_the_command_line_wins(tmp_path: Path) -> None:
    config = _write(
        tmp_path,
        'steps = 7\nport = 9000\nstate-dir = "state"\nfresh = true\n'
        'min_offload_mflop = 2\nlog-format = "json"\nlog-level = "debug"\n',
    )
    args = parse_args(["serve", "--config", str(config), "--port", "9100"])
    assert args.steps == 7
    assert args.port == 9100  # the flag, not the file
    assert args.state_dir == tmp_path / "state"  # relative to the file's directory
    assert args.fresh is True
    assert args.min_offload_mflop == 2.0 and isinstance(args.min_offload_mflop, float)
    assert args.log_format == "json" and args.log_level == "DEBUG"
    assert args.heartbeat_timeout == 10.0  # untouched default


@pytest.mark.parametrize(
    ("text", "intensity", "gflops"),
    [
        ("min-offload-intensity = 60\ncoordinator-gflops = 12.5\n", "60", "12.5"),
        ('min-offload-intensity = "auto"\ncoordinator-gflops = "0"\n', "auto", "0"),
    ],
)
def test_number_or_auto_options_take_either_from_a_file(
    tmp_path: Path, text: str, intensity: str, gflops: str
) -> None:
    # What the command line would give: the number as typed, read as it is there.
    args = parse_args(["serve", "--config", str(_write(tmp_path, text))])
    assert (args.min_offload_intensity, args.coordinator_gflops) == (intensity, gflops)


def test_without_config_the_defaults_stand() -> None:
    args = parse_args(["serve"])
    assert args.config is None and args.steps == 20 and args.log_format == "text"


def test_absolute_and_home_paths_are_kept(tmp_path: Path) -> None:
    config = _write(tmp_path, 'state-dir = "/var/lib/cleave"\nmetrics-out = "~/m.jsonl"\n')
    args = parse_args(["serve", "--config", str(config)])
    assert args.state_dir == Path("/var/lib/cleave")
    assert args.metrics_out == Path("~/m.jsonl").expanduser()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stepz = 3\n", "unknown key 'stepz' (did you mean 'steps'?)"),
        ("config = 'other.toml'\n", "unknown key 'config'"),
        ("steps = '3'\n", "steps must be an integer, not str '3'"),
        ("steps = true\n", "steps must be an integer, not bool True"),
        ("steps = 2.5\n", "steps must be an integer"),
        ("heartbeat-timeout = 'soon'\n", "heartbeat-timeout must be a number"),
        ("fresh = 1\n", "fresh must be true or false"),
        ("state-dir = 3\n", "state-dir must be a path"),
        ("job = ['a']\n", "job must be a string"),
        ("min-offload-intensity = true\n", 'min-offload-intensity must be a number or "auto"'),
        ("log-format = 'xml'\n", "log-format must be one of text, json, not 'xml'"),
        ("[serve]\nsteps = 3\n", "unknown key 'serve'"),
        ("steps = 3\nsteps-x = 1\n", "unknown key 'steps-x'"),
        ("state-dir = 'a'\nstate_dir = 'b'\n", "'state-dir' and 'state_dir' set the same option"),
        ("steps = \n", "is not valid TOML"),
    ],
)
def test_bad_files_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    config = _write(tmp_path, text)
    with pytest.raises(SystemExit) as exited:
        parse_args(["serve", "--config", str(config)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert str(config) in err


def test_a_missing_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--config", str(tmp_path / "absent.toml")])
    assert "cannot read" in capsys.readouterr().err


def test_config_values_is_usable_without_a_file(tmp_path: Path) -> None:
    parser = _serve_parser()
    values = config_values({"steps": 5}, parser, source="inline", base_dir=tmp_path)
    assert values == {"steps": 5}
    with pytest.raises(ConfigError, match="inline: unknown key 'x'"):
        config_values({"x": 1}, parser, source="inline", base_dir=tmp_path)


def test_the_shipped_example_config_is_valid() -> None:
    args = parse_args(["serve", "--config", str(EXAMPLE)])
    assert args.host == "0.0.0.0" and args.port == 8765
    assert args.state_dir == Path("/var/lib/cleave-coordinator")
    assert args.log_format == "json"
    assert args.checkpoint_every >= 1


def test_the_systemd_unit_stops_with_sigterm_and_time_to_checkpoint() -> None:
    unit = (ROOT / "packaging" / "server" / "cleave-coordinator.service").read_text()
    settings = dict(
        line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#")
    )
    assert settings["KillSignal"] == "SIGTERM"
    assert settings["KillMode"] == "mixed"  # local workers are stopped by the coordinator
    assert int(settings["TimeoutStopSec"].rstrip("s")) >= 60
    assert settings["Restart"] == "on-failure"
    assert "143" in settings["SuccessExitStatus"]
    assert "--config" in settings["ExecStart"]
    for hardening in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert settings[hardening] == "true", hardening
    assert settings["ProtectSystem"] == "strict"
