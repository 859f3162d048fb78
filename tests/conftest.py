"""Shared fixtures: real PostgreSQL and SQLite job tables, real Redis, real engines (see tests/fixtures)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = [
    "tests.fixtures.engine",
    "tests.fixtures.tokenizer",
    "tests.fixtures.stack",
    "tests.fixtures.synthetic",
    "tests.fixtures.s3",
]

PG_ADMIN_URL = os.environ.get("HSX_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("HSX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A fresh database on the real PostgreSQL server for this test session, dropped at the end."""
    import psycopg

    name = f"hsx_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    yield f"{base.replace('postgresql://', 'postgresql+psycopg://', 1)}/{name}"
    from hsx.db.session import engine_for

    engine_for.cache_clear()
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty job table on each backend."""
    from sqlalchemy import text

    from hsx.db.migrate import upgrade
    from hsx.db.session import engine_for

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'hsx.sqlite3'}"
        upgrade(url)
        yield url
        return
    url = request.getfixturevalue("pg_server_url")
    upgrade(url)
    yield url
    with engine_for(url).begin() as conn:
        conn.execute(text("TRUNCATE rejections, shards, work_units, jobs CASCADE"))


@pytest.fixture
def redis_url() -> str:
    from redis import Redis

    if not Redis.from_url(REDIS_URL).ping():
        pytest.fail(f"Redis is not reachable at {REDIS_URL}")
    return REDIS_URL
