"""``cleave-coordinator serve --ledger postgresql://...``: a real run records its workers'
verified tiles in PostgreSQL, a restart reads them back, and a ledger that cannot be
opened stops the coordinator with a message (no traceback, no password repeated)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from support.pg_cluster import fresh_database, postgres_url  # noqa: F401  (fixtures)
from support.procs import Coordinator, env_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _rows(url: str) -> dict[str, tuple[int, int]]:
    with psycopg.connect(url) as db:
        found = db.execute("SELECT name, tiles, rejected FROM contributions").fetchall()
    return {name: (tiles, rejected) for name, tiles, rejected in found}


def test_a_run_credits_its_workers_in_postgresql_and_a_restart_keeps_them(
    tmp_path: Path,
    fresh_database: str,  # noqa: F811
) -> None:
    def serve(steps: int) -> Coordinator:
        coord = Coordinator(
            tmp_path, "--ledger", fresh_database, "--steps", str(steps), "--local-workers", "1"
        )
        assert coord.wait(240) == 0, coord.output()
        return coord

    serve(2)
    first = _rows(fresh_database)
    ((name, (tiles, rejected)),) = first.items()
    assert tiles > 0 and rejected == 0, first
    coord = serve(4)  # resumes from the checkpoint: two more steps, the same worker key
    (after,) = _rows(fresh_database).values()
    assert after[0] > tiles, (first, after)
    assert name in coord.output() and "contributions" in coord.output()


def test_a_ledger_that_cannot_be_opened_is_said_in_words(tmp_path: Path) -> None:
    url = "postgresql://cleave:s3cret@127.0.0.1:1/nowhere"  # nothing listens on port 1
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "serve", "--ledger", url, "--steps", "1"],
        cwd=tmp_path,
        env=env_for(tmp_path / "config"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "cannot open the ledger at postgresql://cleave:***@127.0.0.1:1/nowhere" in out, out
    assert "Traceback" not in out and "s3cret" not in out, out
