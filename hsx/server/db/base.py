"""The declarative base every table of the schema derives from, apart from the tables themselves so that
the job tables (:mod:`hsx.server.db.models`), the stream tables (:mod:`hsx.server.db.stream_models`), the
regeneration table (:mod:`hsx.server.db.regenerate_models`) and the exports table
(:mod:`hsx.server.db.export_models`) all build on it without importing each other."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy.orm import DeclarativeBase


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass
