"""Start the desktop app at login, the way each OS expects it (no Qt here).

- Linux and other XDG desktops: ``$XDG_CONFIG_HOME/autostart/cleave-app.desktop``
  (``~/.config/autostart`` by default), per the XDG Autostart spec.
- macOS: ``~/Library/LaunchAgents/org.cleave.app.plist``, a per-user LaunchAgent
  with ``RunAtLoad``; launchd reads it at the next login.
- Windows: the ``Cleave`` value under ``HKCU\\Software\\Microsoft\\Windows\\CurrentVersion\\Run``.

The entry always adds ``--minimized``: a program that opens a window at every login
is the kind volunteers uninstall; the tray icon says it is running.
Platform, home, environment and registry are injectable, so every branch is tested
on any OS without touching the real user's login items.
"""

from __future__ import annotations

import importlib
import os
import plistlib
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from common.atomic_file import atomic_write_bytes

MINIMIZED_FLAG = "--minimized"
DESKTOP_FILE = "cleave-app.desktop"
LAUNCH_AGENT_LABEL = "org.cleave.app"
RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"
RUN_VALUE = "Cleave"


class RunKey(Protocol):
    """The few operations on HKCU\\...\\Run that autostart needs (a dict will do in tests)."""

    def get(self, name: str) -> str | None: ...

    def set(self, name: str, command: str) -> None: ...

    def delete(self, name: str) -> None: ...


def _winreg() -> Any:
    # Imported by name: typeshed declares winreg for win32 only, and mypy runs everywhere.
    return importlib.import_module("winreg")


class WinregRunKey:
    """The real Run key; winreg is imported only here, so only on Windows."""

    def get(self, name: str) -> str | None:
        winreg = _winreg()
        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY) as key:
                value, _ = winreg.QueryValueEx(key, name)
        except FileNotFoundError:
            return None
        return str(value)

    def set(self, name: str, command: str) -> None:
        winreg = _winreg()
        with winreg.CreateKey(winreg.HKEY_CURRENT_USER, RUN_KEY) as key:
            winreg.SetValueEx(key, name, 0, winreg.REG_SZ, command)

    def delete(self, name: str) -> None:
        winreg = _winreg()
        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY, 0, winreg.KEY_SET_VALUE) as key:
                winreg.DeleteValue(key, name)
        except FileNotFoundError:
            pass  # already gone: disabling is idempotent


def app_command(frozen: bool | None = None) -> list[str]:
    """How to start the desktop app: the bundle's own executable (PyInstaller sets
    ``sys.frozen``; its ``sys.executable`` is the app, which knows no ``-m``), else the
    installed launcher, else this Python."""
    if getattr(sys, "frozen", False) if frozen is None else frozen:
        return [sys.executable]
    launcher = shutil.which("cleave-app")
    if launcher:
        return [launcher]
    return [sys.executable, "-m", "client_app.gui"]


def desktop_entry_path(home: Path, environ: Mapping[str, str]) -> Path:
    xdg = environ.get("XDG_CONFIG_HOME")
    # The XDG spec says to ignore relative paths in XDG_CONFIG_HOME.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else home / ".config"
    return base / "autostart" / DESKTOP_FILE


def launch_agent_path(home: Path) -> Path:
    return home / "Library" / "LaunchAgents" / f"{LAUNCH_AGENT_LABEL}.plist"


def _quote_exec_arg(arg: str) -> str:
    # Desktop Entry spec, "The Exec key": quote arguments with reserved characters and
    # backslash-escape ", `, $ and \ inside the quotes; a literal % is written %%.
    arg = arg.replace("%", "%%")
    reserved = set(" \t\n\"'\\><~|&;$*?#()`")
    if not arg or any(ch in reserved for ch in arg):
        escaped = "".join("\\" + ch if ch in '"`$\\' else ch for ch in arg)
        return f'"{escaped}"'
    return arg


def desktop_entry(command: Sequence[str]) -> str:
    exec_line = " ".join(_quote_exec_arg(a) for a in [*command, MINIMIZED_FLAG])
    return (
        "[Desktop Entry]\n"
        "Type=Application\n"
        "Name=Cleave\n"
        "Comment=Lend this computer's spare time to neural-network training\n"
        f"Exec={exec_line}\n"
        "Terminal=false\n"
        "X-GNOME-Autostart-enabled=true\n"
    )


def launch_agent(command: Sequence[str]) -> bytes:
    plist = {
        "Label": LAUNCH_AGENT_LABEL,
        "ProgramArguments": [*command, MINIMIZED_FLAG],
        "RunAtLoad": True,
        # Not KeepAlive: quitting from the tray must stay quit until the next login.
        "ProcessType": "Interactive",
    }
    return plistlib.dumps(plist)


def _kind(platform: str) -> str:
    if platform.startswith("win"):
        return "windows"
    if platform == "darwin":
        return "macos"
    return "xdg"


def _write(path: Path, data: bytes) -> None:
    atomic_write_bytes(path, data)  # a login that read it half-written would run garbage


def enable(
    command: Sequence[str],
    *,
    platform: str | None = None,
    home: Path | None = None,
    environ: Mapping[str, str] | None = None,
    registry: RunKey | None = None,
) -> None:
    """Start ``command --minimized`` at every login of this user. OSError on failure."""
    if not command:
        raise ValueError("autostart needs a command to run")
    kind = _kind(sys.platform if platform is None else platform)
    home_dir = Path.home() if home is None else home
    env = os.environ if environ is None else environ
    if kind == "windows":
        reg = registry if registry is not None else WinregRunKey()
        reg.set(RUN_VALUE, subprocess.list2cmdline([*command, MINIMIZED_FLAG]))
    elif kind == "macos":
        _write(launch_agent_path(home_dir), launch_agent(command))
    else:
        _write(desktop_entry_path(home_dir, env), desktop_entry(command).encode("utf-8"))


def disable(
    *,
    platform: str | None = None,
    home: Path | None = None,
    environ: Mapping[str, str] | None = None,
    registry: RunKey | None = None,
) -> None:
    """Remove the login entry; nothing happens if there is none."""
    kind = _kind(sys.platform if platform is None else platform)
    home_dir = Path.home() if home is None else home
    env = os.environ if environ is None else environ
    if kind == "windows":
        reg = registry if registry is not None else WinregRunKey()
        reg.delete(RUN_VALUE)
    elif kind == "macos":
        launch_agent_path(home_dir).unlink(missing_ok=True)
    else:
        desktop_entry_path(home_dir, env).unlink(missing_ok=True)


def is_enabled(
    *,
    platform: str | None = None,
    home: Path | None = None,
    environ: Mapping[str, str] | None = None,
    registry: RunKey | None = None,
) -> bool:
    """Whether a login entry exists (the user may have removed it by other means)."""
    kind = _kind(sys.platform if platform is None else platform)
    home_dir = Path.home() if home is None else home
    env = os.environ if environ is None else environ
    if kind == "windows":
        reg = registry if registry is not None else WinregRunKey()
        return reg.get(RUN_VALUE) is not None
    if kind == "macos":
        return launch_agent_path(home_dir).exists()
    return desktop_entry_path(home_dir, env).exists()
