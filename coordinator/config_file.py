"""``cleave-coordinator serve --config FILE``: every command-line option, from a TOML file.

Keys are the option names without the leading dashes (``state-dir``; ``state_dir`` is
accepted too). The file's values become the parser's defaults, so anything given on the
command line still wins. The table of allowed keys and their types is read from the
argparse parser itself: an option added to the command line is configurable at once,
and a misspelt key is an error that names it instead of a setting silently ignored.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Any

from common.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML only with the tomli backport
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

# Options that make no sense inside the file they would be read from.
NOT_IN_FILE = frozenset({"help", "config"})


def read_config(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``{dest: value}`` from the TOML file at ``path``, checked against ``parser``'s
    options; relative paths in the file are relative to the file's directory."""
    if tomllib is None:  # pragma: no cover - Python 3.10 without tomli
        raise ConfigError(f"{path}: reading TOML needs Python 3.11+ or `pip install tomli`")
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    return config_values(data, parser, source=str(path), base_dir=path.parent)


def config_values(
    data: dict[str, Any], parser: argparse.ArgumentParser, *, source: str, base_dir: Path
) -> dict[str, Any]:
    """Check parsed TOML ``data`` against ``parser``'s options; ``{dest: value}``."""
    options = _options(parser)
    values: dict[str, Any] = {}
    seen: dict[str, str] = {}  # dest -> the key that set it, to catch "a-b" and "a_b" both
    for key, value in data.items():
        dest = key.replace("-", "_")
        action = options.get(dest)
        if action is None:
            raise ConfigError(_unknown_key(source, key, options))
        if dest in seen:
            raise ConfigError(f"{source}: {seen[dest]!r} and {key!r} set the same option")
        seen[dest] = key
        values[dest] = _checked(source, key, value, action, base_dir)
    return values


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        action.dest: action
        for action in parser._actions
        if action.option_strings and action.dest not in NOT_IN_FILE
    }


def _unknown_key(source: str, key: str, options: dict[str, argparse.Action]) -> str:
    names = sorted(dest.replace("_", "-") for dest in options)
    close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{source}: unknown key {key!r}{hint}; known keys: {', '.join(names)}"


def _checked(source: str, key: str, value: Any, action: argparse.Action, base_dir: Path) -> Any:
    """``value`` converted to what the option's parser would produce, or a ConfigError."""

    def wrong(expected: str) -> ConfigError:
        return ConfigError(
            f"{source}: {key} must be {expected}, not {type(value).__name__} {value!r}"
        )

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if action.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        converted: Any = value
    elif action.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong("a number")
        converted = float(value)
    elif action.type is Path:
        if not isinstance(value, str) or not value:
            raise wrong("a path (a non-empty string)")
        converted = base_dir / Path(value).expanduser()
    elif action.type is None and action.default == "auto":  # a number, or the word auto
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise wrong('a number or "auto"')
        converted = value if isinstance(value, str) else str(value)  # as typed on the line
    elif action.type is None:
        if not isinstance(value, str):
            raise wrong("a string")
        converted = value
    elif callable(action.type):  # a converter of strings, such as str.upper
        if not isinstance(value, str):
            raise wrong("a string")
        try:
            converted = action.type(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {key}: {exc}") from None
    else:  # pragma: no cover - argparse only takes callables as types
        raise ConfigError(f"{source}: {key} cannot be set from a file")
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(
            f"{source}: {key} must be one of {', '.join(map(str, action.choices))}, not {value!r}"
        )
    return converted
