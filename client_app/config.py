"""Where the worker keeps its state: settings and pinned coordinator keys.

Both files are small JSON documents in one config directory, written atomically
(temp file, fsync, rename), so a crash or power cut leaves the old or the new file,
never half of one. The desktop app reads and writes the same files.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client_app.policy import Schedule, Snooze
from common.atomic_file import atomic_write_bytes
from common.errors import ConfigError, KeyMismatchError
from common.signing import load_or_create_private_key

CONFIG_DIR_ENV = "CLEAVE_CONFIG_DIR"
PINS_FILE = "known_coordinators.json"
IDENTITY_FILE = "worker.key"  # this worker's Ed25519 key: its identity and its credit
SETTINGS_FILE = "settings.json"
MAX_WINDOW = 64  # what common.messages.Hello accepts
MAX_NAME_CHARS = 64  # well inside the wire's max_string_chars


def config_dir(
    environ: Mapping[str, str] | None = None,
    platform: str | None = None,
    home: Path | None = None,
) -> Path:
    """The directory for settings and pins; ``CLEAVE_CONFIG_DIR`` wins over the platform's."""
    env = os.environ if environ is None else environ
    plat = sys.platform if platform is None else platform
    home_dir = Path.home() if home is None else home
    override = env.get(CONFIG_DIR_ENV)
    if override:
        return Path(override)
    if plat.startswith("win"):
        appdata = env.get("APPDATA")
        return (Path(appdata) if appdata else home_dir / "AppData" / "Roaming") / "Cleave"
    if plat == "darwin":
        return home_dir / "Library" / "Application Support" / "Cleave"
    xdg = env.get("XDG_CONFIG_HOME")
    # The XDG spec says to ignore relative paths in XDG_CONFIG_HOME.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else home_dir / ".config"
    return base / "cleave"


def atomic_write_json(path: Path, obj: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON so that readers see the old or the new file."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path} is not readable JSON ({exc}); fix or delete it") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object; fix or delete it")
    return data


class PinStore:
    """Coordinator URL -> public key hex, pinned on first use (like SSH's known_hosts)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def in_dir(cls, directory: Path) -> PinStore:
        return cls(directory / PINS_FILE)

    def load(self) -> dict[str, str]:
        # A corrupt pin file must not read as "nothing pinned": that would silently
        # accept any key, which is what pinning exists to prevent.
        data = _read_json_object(self.path)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ConfigError(f"{self.path} must map URLs to key strings; fix or delete it")
        return dict(data)

    def get(self, url: str) -> str | None:
        return self.load().get(url)

    def check(self, url: str, key_hex: str) -> bool:
        """Accept ``key_hex`` for ``url``: True if it was pinned just now (first join).

        Raises KeyMismatchError if a different key is pinned for this URL.
        """
        pins = self.load()
        pinned = pins.get(url)
        if pinned is None:
            pins[url] = key_hex
            atomic_write_json(self.path, pins)
            return True
        if pinned.lower() != key_hex.lower():
            raise KeyMismatchError(url, pinned, key_hex)
        return False

    def forget(self, url: str) -> bool:
        """Remove the pin for ``url``; False if there was none."""
        pins = self.load()
        if pins.pop(url, None) is None:
            return False
        atomic_write_json(self.path, pins)
        return True


def load_identity(directory: Path) -> Ed25519PrivateKey:
    """This worker's key, made on first start (readable by the owner only).

    Credit and reputation at every coordinator follow this key, not the name; losing it
    starts a new identity with no credit, so it lives with the settings, not in a cache.
    """
    try:
        return load_or_create_private_key(directory / IDENTITY_FILE)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot use the worker key {directory / IDENTITY_FILE}: {exc}; "
            "delete it to start a new identity (its credit stays with the old key)"
        ) from None


def default_threads() -> int:
    # Leave half the cores to the owner: a volunteer machine must stay usable.
    return max(1, (os.cpu_count() or 2) // 2)


def generate_name() -> str:
    """A readable, probably unique worker name: hostname plus a short random suffix."""
    host = socket.gethostname().split(".")[0] or "worker"
    return f"{host[: MAX_NAME_CHARS - 5]}-{secrets.token_hex(2)}"


@dataclass(frozen=True)
class WorkerSettings:
    """The owner's choices, shared by the CLI and the desktop app (``settings.json``)."""

    coordinator_url: str = ""
    name: str = ""  # empty: generate one on first run and persist it
    threads: int = 0  # 0: default_threads()
    use_gpu: bool = True
    memory_mb: int = 0  # tile memory cap; 0: min(1 GiB, 25% of RAM)
    window: int = 2  # tiles in flight: one computing while the next one arrives
    cpu_percent: int = 100  # duty cycle: share of time spent computing (1..100)
    # While the owner uses the computer (client_app.policy's idle detector says "in
    # use"), these replace cpu_percent and threads; 0% pauses, as idle_only does.
    in_use_cpu_percent: int = 100  # 0..100
    in_use_threads: int = 0  # 0: the same as threads
    # When to compute (client_app.policy). Defaults keep a plain worker computing as
    # before, except on battery: draining a laptop unasked is the one surprise no
    # volunteer wants, and a machine without a battery never sees it.
    idle_only: bool = False  # compute only while the owner is not using the machine
    idle_threshold_percent: float = 25.0  # other processes' CPU below this counts as idle
    idle_minutes: float = 5.0  # ... for this long (and no keyboard/mouse input, if known)
    pause_on_battery: bool = True
    schedule: str = ""  # daily windows, "22:00-07:00,12:00-13:00"; empty: any time
    snooze_until: str = ""  # ISO local time; empty: not snoozed
    # Pause above these temperatures, resume temp_hysteresis_c below them; 0: no limit.
    max_cpu_temp_c: float = 0.0
    max_gpu_temp_c: float = 0.0
    temp_hysteresis_c: float = 5.0
    bandwidth_kbps: int = 0  # per direction, KiB/s (client_app.bandwidth); 0: unlimited
    # Share the GPU only while no other program is using it (client_app.gpu_busy).
    gpu_only_when_free: bool = True
    start_at_login: bool = False  # client_app.autostart keeps the OS entry in step
    start_minimized: bool = False  # the desktop app opens to its tray icon only
    join_token: str = ""  # a private pool's token; only an HMAC of it is ever sent

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads must be >= 1 (or 0 for the default), not {self.threads}")
        if self.memory_mb < 0:
            raise ValueError(f"memory_mb must be >= 0, not {self.memory_mb}")
        if self.bandwidth_kbps < 0:
            raise ValueError(f"bandwidth_kbps must be >= 0, not {self.bandwidth_kbps}")
        if not 1 <= self.cpu_percent <= 100:
            raise ValueError(f"cpu_percent must be in [1, 100], not {self.cpu_percent}")
        if not 0 <= self.in_use_cpu_percent <= 100:
            raise ValueError(
                f"in_use_cpu_percent must be in [0, 100], not {self.in_use_cpu_percent}"
            )
        if self.in_use_threads < 0:
            raise ValueError(
                f"in_use_threads must be >= 1 (or 0 for threads), not {self.in_use_threads}"
            )
        if not 1 <= self.window <= MAX_WINDOW:
            raise ValueError(f"window must be in [1, {MAX_WINDOW}], not {self.window}")
        if len(self.name) > MAX_NAME_CHARS:
            raise ValueError(f"name must be at most {MAX_NAME_CHARS} characters")
        self._check_policy()

    def _check_policy(self) -> None:
        if not 0.0 <= self.idle_threshold_percent <= 100.0:
            raise ValueError(
                f"idle_threshold_percent must be in [0, 100], not {self.idle_threshold_percent}"
            )
        if not 0.0 < self.idle_minutes <= 24 * 60:
            raise ValueError(f"idle_minutes must be in (0, 1440], not {self.idle_minutes}")
        for name in ("max_cpu_temp_c", "max_gpu_temp_c"):
            value = getattr(self, name)
            if not (value == 0.0 or 20.0 <= value <= 120.0):
                raise ValueError(f"{name} must be 0 (no limit) or in [20, 120] °C, not {value}")
        if not 1.0 <= self.temp_hysteresis_c <= 30.0:
            raise ValueError(
                f"temp_hysteresis_c must be in [1, 30] °C, not {self.temp_hysteresis_c}"
            )
        Schedule.parse(self.schedule)  # ValueError says what is wrong
        Snooze.from_iso(self.snooze_until)

    @property
    def effective_threads(self) -> int:
        return self.threads or default_threads()

    @property
    def effective_in_use_threads(self) -> int:
        return self.in_use_threads or self.effective_threads

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WorkerSettings:
        """Known keys only (a newer app may add others); a wrong type is a ConfigError."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            expected = type(getattr(cls(), f.name))
            # bool is an int subclass: "threads": true must not read as 1 thread.
            if expected is float and type(value) is int:
                value = float(value)  # hand-edited JSON writes 5 for 5.0
            if type(value) is not expected:
                raise ConfigError(
                    f"settings field {f.name!r} must be {expected.__name__}, not {value!r}"
                )
            values[f.name] = value
        try:
            return cls(**values)
        except ValueError as exc:
            raise ConfigError(f"settings: {exc}") from None

    @classmethod
    def load(cls, directory: Path) -> WorkerSettings:
        return cls.from_json(_read_json_object(directory / SETTINGS_FILE))

    def save(self, directory: Path) -> None:
        # Merge into the existing object so keys this version does not know survive.
        path = directory / SETTINGS_FILE
        data = _read_json_object(path)
        data.update(self.to_json())
        atomic_write_json(path, data)

    def with_name(self) -> WorkerSettings:
        """These settings with a generated name if none is set."""
        return self if self.name else replace(self, name=generate_name())
