"""The coordinator's output: text for people at a terminal, or JSON lines for machines.

Everything the coordinator says goes through ``logging``. Progress (the banner, one line
per step, the summary) goes to the ``cleave.progress`` logger, which always writes to
stdout; in text mode it prints just the message, exactly the lines people and tests
read, while diagnostics keep their timestamped format on stderr. In JSON mode every
record, progress and diagnostics alike, is one JSON object per line on stdout with
``time``, ``level``, ``logger``, ``message`` and the record's extra fields (a step line
carries ``step``, ``loss``, ``seconds``, ...), ready for journald or a log shipper.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
PROGRESS_LOGGER = "cleave.progress"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came in through ``extra=``.
_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, extra fields included."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        # default=str: a Path or an exception in ``extra`` must not lose the whole line.
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure(
    log_format: str,
    level: int,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> None:
    """Install the handlers for ``log_format`` ("text" or "json"), replacing any others."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    root = logging.getLogger()
    progress = logging.getLogger(PROGRESS_LOGGER)
    for logger in (root, progress):
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
    root.setLevel(level)
    # Progress is what the run is for: shown whatever --log-level says.
    progress.setLevel(logging.INFO)
    progress.propagate = False
    if log_format == "json":
        everything = logging.StreamHandler(out)
        everything.setFormatter(JsonFormatter())
        root.addHandler(everything)
        progress.addHandler(everything)
        return
    diagnostics = logging.StreamHandler(err)
    diagnostics.setFormatter(logging.Formatter(TEXT_FORMAT))
    root.addHandler(diagnostics)
    plain = logging.StreamHandler(out)
    plain.setFormatter(logging.Formatter("%(message)s"))
    progress.addHandler(plain)
