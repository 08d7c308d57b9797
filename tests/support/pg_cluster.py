"""A throwaway PostgreSQL server on 127.0.0.1 for the tests that need one.

``postgres_url`` (a session fixture) is ``CLEAVE_TEST_POSTGRES_URL`` where that is set,
else a cluster made with the installed PostgreSQL binaries (Debian's ``postgresql``
package; ``.ci/run`` installs it) in a temporary directory, trusting local connections,
listening on loopback only, and stopped at the end of the session. Without PostgreSQL
the tests that need it skip, saying so. ``fresh_database`` gives each test a database of
its own.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ENV = "CLEAVE_TEST_POSTGRES_URL"


def _binaries() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(argv: list[str]) -> list[str]:
    """initdb and the server refuse to run as root: run them as the postgres user."""
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", "postgres", "--", *argv]


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    if os.environ.get(ENV):
        yield os.environ[ENV]
        return
    bin_dir = _binaries()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql), nor " + ENV)
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root without a postgres user to run PostgreSQL as")
    root = Path(tempfile.mkdtemp(prefix="cleave-pg-"))
    if os.geteuid() == 0:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    data, port = root / "data", _free_port()
    run = dict(check=True, capture_output=True, timeout=120)
    subprocess.run(
        _as_postgres([str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"]),
        **run,  # type: ignore[arg-type]
    )
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    ctl = [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "log")]
    subprocess.run(_as_postgres([*ctl, "-o", options, "-w", "start"]), **run)  # type: ignore[arg-type]
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_postgres([*ctl, "-m", "immediate", "stop"]), capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def fresh_database(postgres_url: str) -> Iterator[str]:
    """The URL of a database made for this test, dropped after it."""
    import psycopg

    name = "t" + uuid.uuid4().hex[:12]
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    base = postgres_url.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
