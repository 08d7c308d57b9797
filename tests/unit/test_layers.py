"""The import contracts in pyproject.toml (import-linter): common is the shared base, the
coordinator and the worker never import each other, Qt stays in client_app.gui, the
coordinator's packages import only those below them (coordinator/__init__.py), planning
and scheduling are pure, the core does no I/O and the simulator runs it without the server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def test_the_layer_contracts_are_kept() -> None:
    assert LINT_IMPORTS.exists(), "import-linter is missing: pip install -e '.[test]'"
    done = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout
