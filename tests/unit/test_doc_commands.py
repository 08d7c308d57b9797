"""Every command the README and the guides show runs as written: each `cleave-coordinator`,
`cleave-worker`, `cleave-app` and `python -m coordinator.sim` command parses with the
program's own parser, each `make` target and variable exists, each bench script exists
and takes the flags shown. Commands are read from fenced blocks and from inline code.
(`tests/e2e/test_e2e_readme.py` runs the README's `make demo` and compares its output
with the README's.)"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _coordinator() -> argparse.ArgumentParser:
    from coordinator.cli import build_parser

    return build_parser()


def _worker() -> argparse.ArgumentParser:
    from client_app.cli import build_parser

    return build_parser()


def _app() -> argparse.ArgumentParser:
    from client_app.gui.app import build_parser

    return build_parser()


def _simulator() -> argparse.ArgumentParser:
    from coordinator.sim.__main__ import build_parser

    return build_parser()


PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "cleave-coordinator": _coordinator,
    "cleave-worker": _worker,
    "cleave-app": _app,
    "coordinator.sim": _simulator,  # python -m coordinator.sim
    "coordinator": _coordinator,  # torchrun ... -m coordinator
}
PYTHONS = ("python", "python3", ".venv/bin/python", "$(BIN)/python")


def doc_commands(text: str) -> Iterator[tuple[str, bool]]:
    """Command lines in fenced blocks (continuations joined) and in inline code spans,
    each with whether it was inline (where a program's bare name is a mention, not a
    command)."""
    fenced = False
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced, pending = not fenced, ""
            continue
        if fenced:
            pending += line.strip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            yield pending, False
            pending = ""
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield span, True


def program_and_args(command: str) -> tuple[str, list[str]] | None:
    """The program a documented command runs and its arguments (None: not one of ours)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    while words and (re.fullmatch(r"[A-Z_]+=\S*", words[0]) or words[0] == "sudo"):
        words = words[1:]  # environment variables, sudo
    if not words:
        return None
    program, args = Path(words[0]).name, words[1:]
    if "/" in words[0] and not words[0].endswith(f"/bin/{program}"):
        return None  # a path, not a program
    if words[0] in PYTHONS or program == "torchrun":
        if "-m" in args:
            module_at = args.index("-m") + 1
            return args[module_at], args[module_at + 1 :]
        script = next((a for a in args if a.endswith(".py")), None)
        if script is None:
            return None
        return script, args[args.index(script) + 1 :]
    if program in {"cleave-coordinator", "cleave-worker", "cleave-app", "make"}:
        return program, args
    return None


def documented() -> list[tuple[str, str, str, list[str]]]:
    found = []
    for doc in DOCS:
        for command, inline in doc_commands(doc.read_text()):
            parsed = program_and_args(command)
            if parsed is not None and (parsed[1] or not inline):
                program, args = parsed
                found.append((doc.relative_to(ROOT).as_posix(), command, program, args))
    return found


COMMANDS = documented()


def test_the_docs_show_the_commands_this_test_checks() -> None:
    programs = {program for _, _, program, _ in COMMANDS}
    assert {"cleave-coordinator", "cleave-worker", "cleave-app", "make"} <= programs
    assert "coordinator.sim" in programs and "coordinator" in programs
    assert any(p.startswith("bench/") for p in programs)


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> str:
    """'' when argparse accepts ``args`` (``--help`` included), else what it said."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as exc:
        return "" if exc.code == 0 else errors.getvalue().strip()
    return ""


@pytest.mark.parametrize(
    "doc,command,program,args",
    [c for c in COMMANDS if c[2] in PARSERS],
    ids=lambda v: v if isinstance(v, str) and " " not in v else None,
)
def test_each_documented_command_parses(
    doc: str, command: str, program: str, args: list[str]
) -> None:
    # "..." stands for the options shown elsewhere on the page.
    error = _parse(PARSERS[program](), [a for a in args if a != "..."])
    assert not error, f"{doc}: `{command}` does not parse: {error}"


def _makefile() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", text, re.MULTILINE))
    variables = set(re.findall(r"^([A-Z_]+)\s*\??=", text, re.MULTILINE))
    return targets, variables


def test_each_documented_make_command_names_a_target_and_its_variables() -> None:
    targets, variables = _makefile()
    checked = 0
    for doc, command, program, args in COMMANDS:
        if program != "make":
            continue
        for arg in args:
            if "=" in arg:
                assert arg.split("=")[0] in variables, f"{doc}: `{command}`: no such variable"
            elif not arg.startswith("-"):
                assert arg in targets, f"{doc}: `{command}`: no target {arg!r} in the Makefile"
        checked += 1
    assert checked >= 3


def test_each_documented_script_exists_and_takes_the_flags_shown() -> None:
    checked = 0
    for doc, command, program, args in COMMANDS:
        if not program.endswith(".py"):
            continue
        script = ROOT / program
        assert script.is_file(), f"{doc}: `{command}`: no {program}"
        source = script.read_text()
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            assert f'"{flag}"' in source, f"{doc}: `{command}`: {program} takes no {flag}"
        checked += 1
    assert checked >= 5


def test_a_wrong_option_in_a_doc_would_be_caught() -> None:
    parsed = program_and_args("cleave-coordinator serve --stepz 5")
    assert parsed is not None
    assert "--stepz" in _parse(PARSERS[parsed[0]](), parsed[1])
    lines = list(
        doc_commands("```\nGLOO=1 torchrun --nnodes 2 \\\n  -m coordinator serve --port 1\n```")
    )
    assert [program_and_args(line) for line, _ in lines] == [
        ("coordinator", ["serve", "--port", "1"])
    ]
