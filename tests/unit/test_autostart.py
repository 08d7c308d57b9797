"""Start at login on each OS, in temporary homes and a fake registry (no real login items)."""

from __future__ import annotations

import plistlib
import subprocess
import sys
from pathlib import Path

import pytest

from client_app import autostart

CMD = ["/opt/My Apps/cleave-app", "--profile=50%"]


class FakeRunKey:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def get(self, name: str) -> str | None:
        return self.values.get(name)

    def set(self, name: str, command: str) -> None:
        self.values[name] = command

    def delete(self, name: str) -> None:
        self.values.pop(name, None)


def test_linux_desktop_entry_in_xdg_config_home(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    opts = dict(platform="linux", home=tmp_path / "home", environ=env)
    assert not autostart.is_enabled(**opts)
    autostart.enable(CMD, **opts)
    entry = tmp_path / "xdg" / "autostart" / "cleave-app.desktop"
    text = entry.read_text(encoding="utf-8")
    assert text.startswith("[Desktop Entry]\n") and "Type=Application\n" in text
    # Spaces quoted, % doubled (the spec's field codes), and the tray-only flag added.
    assert 'Exec="/opt/My Apps/cleave-app" --profile=50%% --minimized\n' in text
    assert autostart.is_enabled(**opts)
    autostart.disable(**opts)
    assert not entry.exists() and not autostart.is_enabled(**opts)
    autostart.disable(**opts)  # idempotent


def test_linux_without_xdg_config_home_uses_dot_config(tmp_path: Path) -> None:
    # A relative XDG_CONFIG_HOME is ignored, as the spec says.
    autostart.enable(
        ["cleave-app"], platform="linux", home=tmp_path, environ={"XDG_CONFIG_HOME": "rel"}
    )
    entry = tmp_path / ".config" / "autostart" / "cleave-app.desktop"
    assert "Exec=cleave-app --minimized\n" in entry.read_text(encoding="utf-8")


def test_macos_launch_agent(tmp_path: Path) -> None:
    opts = dict(platform="darwin", home=tmp_path, environ={})
    autostart.enable(CMD, **opts)
    path = tmp_path / "Library" / "LaunchAgents" / "org.cleave.app.plist"
    plist = plistlib.loads(path.read_bytes())
    assert plist["Label"] == "org.cleave.app"
    assert plist["ProgramArguments"] == [*CMD, "--minimized"]
    assert plist["RunAtLoad"] is True and "KeepAlive" not in plist
    assert autostart.is_enabled(**opts)
    autostart.disable(**opts)
    assert not path.exists() and not autostart.is_enabled(**opts)


def test_windows_run_key(tmp_path: Path) -> None:
    reg = FakeRunKey()
    opts = dict(platform="win32", home=tmp_path, environ={}, registry=reg)
    assert not autostart.is_enabled(**opts)
    autostart.enable(CMD, **opts)
    assert reg.values == {"Cleave": subprocess.list2cmdline([*CMD, "--minimized"])}
    assert reg.values["Cleave"].startswith('"/opt/My Apps/cleave-app" ')
    assert autostart.is_enabled(**opts)
    autostart.disable(**opts)
    assert reg.values == {} and not autostart.is_enabled(**opts)
    assert list(tmp_path.iterdir()) == []  # nothing written to disk on Windows


def test_empty_command_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        autostart.enable([], platform="linux", home=tmp_path, environ={})


def test_app_command_is_a_runnable_command() -> None:
    command = autostart.app_command()
    assert command and all(isinstance(part, str) and part for part in command)


def test_a_bundled_app_starts_itself_at_login() -> None:
    # In a PyInstaller bundle sys.executable is the app: "-m client_app.gui" would break.
    assert autostart.app_command(frozen=True) == [sys.executable]
