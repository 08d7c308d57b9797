"""Config directory, pinned coordinator keys (trust on first use) and settings.json."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from client_app import config
from client_app.config import (
    PinStore,
    WorkerSettings,
    atomic_write_json,
    config_dir,
)
from common.errors import ConfigError, KeyMismatchError

URL = "ws://coord.example:8765/ws"
KEY_A = "aa" * 32
KEY_B = "bb" * 32


def test_config_dir_env_wins_on_every_platform(tmp_path: Path) -> None:
    for plat in ("linux", "win32", "darwin"):
        env = {"CLEAVE_CONFIG_DIR": str(tmp_path), "APPDATA": "C:/x", "XDG_CONFIG_HOME": "/x"}
        assert config_dir(env, plat, Path("/home/u")) == tmp_path


def test_config_dir_per_platform() -> None:
    home = Path("/home/u")
    assert config_dir({}, "linux", home) == home / ".config" / "cleave"
    assert config_dir({"XDG_CONFIG_HOME": "/xdg"}, "linux", home) == Path("/xdg/cleave")
    # A relative XDG_CONFIG_HOME is invalid per the spec and ignored.
    assert config_dir({"XDG_CONFIG_HOME": "rel"}, "linux", home) == home / ".config" / "cleave"
    assert config_dir({"APPDATA": "/appdata"}, "win32", home) == Path("/appdata/Cleave")
    assert config_dir({}, "darwin", home) == home / "Library" / "Application Support" / "Cleave"


def test_tests_never_use_the_real_config_dir(tmp_path: Path) -> None:
    assert Path(os.environ["CLEAVE_CONFIG_DIR"]) != Path.home() / ".config" / "cleave"
    assert config_dir() == Path(os.environ["CLEAVE_CONFIG_DIR"])


def test_first_join_pins_then_same_key_is_accepted(tmp_path: Path) -> None:
    pins = PinStore.in_dir(tmp_path)
    assert pins.get(URL) is None
    assert pins.check(URL, KEY_A) is True  # pinned just now
    assert json.loads((tmp_path / "known_coordinators.json").read_text()) == {URL: KEY_A}
    assert pins.check(URL, KEY_A) is False  # already pinned, same key: fine
    assert PinStore.in_dir(tmp_path).get(URL) == KEY_A  # survives a restart


def test_a_different_key_is_refused_and_the_pin_kept(tmp_path: Path) -> None:
    pins = PinStore.in_dir(tmp_path)
    pins.check(URL, KEY_A)
    with pytest.raises(KeyMismatchError) as info:
        pins.check(URL, KEY_B)
    assert info.value.pinned == KEY_A and info.value.presented == KEY_B
    assert f"--forget {URL}" in str(info.value)
    assert pins.get(URL) == KEY_A
    # Pins are per URL: another coordinator gets its own first-use pin.
    assert pins.check("ws://other:1/ws", KEY_B) is True


def test_forget_removes_only_that_pin(tmp_path: Path) -> None:
    pins = PinStore.in_dir(tmp_path)
    pins.check(URL, KEY_A)
    pins.check("ws://other:1/ws", KEY_B)
    assert pins.forget(URL) is True
    assert pins.forget(URL) is False
    assert pins.load() == {"ws://other:1/ws": KEY_B}
    assert pins.check(URL, KEY_B) is True  # re-pinned after forgetting


def test_corrupt_pin_file_is_an_error_not_an_empty_store(tmp_path: Path) -> None:
    (tmp_path / "known_coordinators.json").write_text("{not json")
    with pytest.raises(ConfigError, match="known_coordinators.json"):
        PinStore.in_dir(tmp_path).check(URL, KEY_A)
    (tmp_path / "known_coordinators.json").write_text(json.dumps({URL: 5}))
    with pytest.raises(ConfigError):
        PinStore.in_dir(tmp_path).get(URL)


def test_atomic_write_leaves_the_old_file_when_the_rename_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "pins.json"
    atomic_write_json(target, {"old": 1})
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))

    def broken_replace(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(config.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_json(target, {"new": 2})
    assert json.loads(target.read_text()) == {"old": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pins.json"]  # no temp file left
    assert synced, "the temp file must be fsynced before the rename"
    monkeypatch.undo()
    atomic_write_json(target, {"new": 2})
    assert json.loads(target.read_text()) == {"new": 2}


def test_settings_round_trip_and_keep_unknown_keys(tmp_path: Path) -> None:
    (tmp_path / "settings.json").write_text(json.dumps({"theme": "dark", "threads": 3}))
    loaded = WorkerSettings.load(tmp_path)
    assert loaded == WorkerSettings(threads=3)
    changed = WorkerSettings(
        coordinator_url=URL, name="box-1a2b", threads=2, use_gpu=False, memory_mb=512, window=3
    )
    changed.save(tmp_path)
    assert WorkerSettings.load(tmp_path) == changed
    # A key written by a newer desktop app survives the CLI saving its own fields.
    assert json.loads((tmp_path / "settings.json").read_text())["theme"] == "dark"


def test_missing_settings_file_gives_defaults(tmp_path: Path) -> None:
    settings = WorkerSettings.load(tmp_path)
    assert settings == WorkerSettings()
    assert settings.window == 2 and settings.use_gpu and settings.memory_mb == 0
    assert settings.effective_threads >= 1


@pytest.mark.parametrize(
    "data",
    [{"threads": "4"}, {"threads": True}, {"use_gpu": 1}, {"window": 0}, {"threads": -1}],
)
def test_bad_settings_are_a_config_error(tmp_path: Path, data: dict[str, object]) -> None:
    (tmp_path / "settings.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError):
        WorkerSettings.load(tmp_path)


def test_generated_name_is_hostname_plus_suffix() -> None:
    names = {WorkerSettings().with_name().name for _ in range(5)}
    host = config.socket.gethostname().split(".")[0]
    for name in names:
        assert re.fullmatch(re.escape(host[:59]) + r"-[0-9a-f]{4}", name), name
    assert len(names) > 1  # the suffix tells two machines with one hostname apart
    assert WorkerSettings(name="mine").with_name().name == "mine"
