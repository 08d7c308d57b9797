"""What a job is, in the operator's words: what volunteers see before they help.

The coordinator sends it in its signed Welcome; workers show it as plain text. It is a
stranger's text on the volunteer's screen, so both sides hold it to the same rules: short
fields, a description of at most a few paragraphs, no control characters (they could
rewrite a terminal or hide text), and a link that is only ever an http(s) address.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

MAX_NAME_CHARS = 80
MAX_DESCRIPTION_CHARS = 1000
MAX_OPERATOR_CHARS = 100
MAX_LINK_CHARS = 300
MAX_NOTE_CHARS = 300  # common.messages.JobState.note
LINK_SCHEMES = ("https://", "http://")


def text_problem(value: str, *, max_chars: int, multiline: bool = False) -> str:
    """Why ``value`` cannot be shown to volunteers ("" when it can)."""
    if len(value) > max_chars:
        return f"is {len(value)} characters long; at most {max_chars} are shown"
    for ch in value:
        if ch == "\n" and multiline:
            continue
        # Cc: control characters (escape sequences, carriage returns); Cf: invisible
        # format characters such as right-to-left overrides that disguise text.
        if unicodedata.category(ch) in ("Cc", "Cf"):
            return f"contains the control character U+{ord(ch):04X}"
    return ""


def link_problem(link: str) -> str:
    """Why ``link`` is not an address to show ("" when it is, or is empty)."""
    if not link:
        return ""
    problem = text_problem(link, max_chars=MAX_LINK_CHARS)
    if problem:
        return problem
    if not link.lower().startswith(LINK_SCHEMES) or any(ch.isspace() for ch in link):
        return "must be an http:// or https:// address without spaces"
    return ""


@dataclass(frozen=True)
class JobAbout:
    """The job's public description. ValueError for a field volunteers cannot be shown."""

    name: str
    description: str = ""
    operator: str = ""  # who runs the job: a person, a lab, a company
    link: str = ""  # where to read more: http(s) only
    parameters: int = 0  # the model's size; 0: not told

    def __post_init__(self) -> None:
        problems = {
            "name": text_problem(self.name, max_chars=MAX_NAME_CHARS),
            "description": text_problem(
                self.description, max_chars=MAX_DESCRIPTION_CHARS, multiline=True
            ),
            "operator": text_problem(self.operator, max_chars=MAX_OPERATOR_CHARS),
            "link": link_problem(self.link),
        }
        for field, problem in problems.items():
            if problem:
                raise ValueError(f"the job's {field} {problem}")
        if not self.name.strip():
            raise ValueError("the job's name must not be empty")
        if isinstance(self.parameters, bool) or not 0 <= self.parameters < 1 << 53:
            raise ValueError(f"the job's parameter count {self.parameters!r} is not a count")

    def to_header(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "operator": self.operator,
            "link": self.link,
            "parameters": self.parameters,
        }

    @classmethod
    def from_header(cls, h: Any) -> JobAbout:
        """From a received header object; ValueError says which field is wrong."""
        if not isinstance(h, dict):
            raise ValueError("the job description must be an object")
        values: dict[str, Any] = {}
        for field in ("name", "description", "operator", "link"):
            value = h.get(field, "")
            if not isinstance(value, str):
                raise ValueError(f"the job's {field} must be a string")
            values[field] = value
        parameters = h.get("parameters", 0)
        if isinstance(parameters, bool) or not isinstance(parameters, int):
            raise ValueError("the job's parameter count must be an integer")
        return cls(parameters=parameters, **values)
