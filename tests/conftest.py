"""Shared fixtures: real PostgreSQL and SQLite job tables, real Redis, real engines (see tests/fixtures)."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = [
    "tests.skips",
    "tests.fixtures.engine",
    "tests.fixtures.tokenizer",
    "tests.fixtures.stack",
    "tests.fixtures.synthetic",
    "tests.fixtures.s3",
    "tests.fixtures.ports",
]

PG_ADMIN_URL = os.environ.get("HSX_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("HSX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(autouse=True)
def _settings_read_afresh() -> Iterator[None]:
    """Every test reads settings from its own environment: a cached Settings object left by an earlier test
    (an S3 output address, say) would otherwise steer this one's finalize or publication."""
    from hsx.server.settings import get_settings

    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A fresh database on the real PostgreSQL server for this test session, dropped at the end."""
    import psycopg

    name = f"hsx_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    yield f"{base.replace('postgresql://', 'postgresql+psycopg://', 1)}/{name}"
    from hsx.server.db.session import engine_for

    engine_for.cache_clear()
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated, empty SQLite job table, made once a session: each test gets a copy of the file, which is
    what running the migrations again would write, without their second or so a test."""
    import sqlite3

    from hsx.server.db.migrate import upgrade

    path = tmp_path_factory.mktemp("sqlite-template") / "hsx.sqlite3"
    upgrade(f"sqlite:///{path}")
    # Fold the write-ahead log into the file, so that the file alone is the whole migrated database.
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path


@pytest.fixture(scope="session")
def _pg_migrated(pg_server_url: str) -> str:
    """The session's PostgreSQL database, migrated once; each test empties the tables after itself."""
    from hsx.server.db.migrate import upgrade

    upgrade(pg_server_url)
    return pg_server_url


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty job table on each backend."""
    from sqlalchemy import text

    from hsx.server.db.session import engine_for

    if request.param == "sqlite":
        path = tmp_path / "hsx.sqlite3"
        shutil.copyfile(request.getfixturevalue("_sqlite_template"), path)
        yield f"sqlite:///{path}"
        return
    url = request.getfixturevalue("_pg_migrated")
    yield url
    with engine_for(url).begin() as conn:
        conn.execute(text("TRUNCATE rejections, shards, work_units, jobs CASCADE"))


@pytest.fixture
def redis_url() -> str:
    from redis import Redis

    if not Redis.from_url(REDIS_URL).ping():
        pytest.fail(f"Redis is not reachable at {REDIS_URL}")
    return REDIS_URL


# Modules whose tests run longest (worker processes, engine-bound jobs, fuzzing), collected first: xdist hands
# tests out in collection order as workers free up, so the long ones start early and the short ones fill the
# end instead of one worker finishing a soak alone. Whole modules move, so module fixtures stay contiguous.
LONG_MODULES_FIRST = (
    "test_faults.py",
    "test_soak.py",
    "test_fp8_jobs.py",
    "test_api_security.py",
    "test_jobs_e2e.py",
    "test_export_trainers.py",
    "test_metrics.py",
    "test_specforge_stream.py",
    "test_sglang_arch_matrix.py",
    "test_multi_engine.py",
    "test_job_options.py",
    "test_s3_job.py",
    "test_stream_faults.py",
    "test_console_worker.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a module kept
