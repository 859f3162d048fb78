"""Engines and sessions: PostgreSQL in production, an embedded SQLite file where one machine serves."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from hsx.server.retry import DATABASE


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # WAL lets the API read while a worker writes; busy_timeout makes writers queue instead of failing.
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=FULL")
    cur.close()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # pre_ping lets a worker ride out a database restart instead of failing on a dead pooled connection.
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)


@lru_cache(maxsize=8)
def engine_for(url: str) -> Engine:
    engine = make_engine(url)
    _ENGINES_SEEN.append(engine)
    return engine


def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(bind=engine_for(url), expire_on_commit=False)


def retry_db(fn: Any) -> Any:
    """Ride out a database restart: the operation is idempotent or fenced, so retrying is safe."""
    return DATABASE.call(fn, (OperationalError,), "a database call")


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """One transaction: commit on success, roll back on any error."""
    session = session_factory(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def _forget_engines_in_child() -> None:
    # A forked RQ work horse must not share the parent's pooled sockets: drop them without closing them.
    for engine in _ENGINES_SEEN:
        engine.dispose(close=False)
    engine_for.cache_clear()
    _ENGINES_SEEN.clear()


_ENGINES_SEEN: list[Engine] = []
os.register_at_fork(after_in_child=_forget_engines_in_child)
