"""Request-scoped dependencies: settings and a database session per request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends
from sqlalchemy.orm import Session

from hsx.server.db.session import session_factory
from hsx.server.settings import Settings, get_settings


async def settings_dep() -> Settings:
    # Async: a sync dependency costs a hop to the thread pool on every request.
    return get_settings()


SettingsDep = Annotated[Settings, Depends(settings_dep)]


def session_dep(settings: SettingsDep) -> Iterator[Session]:
    session = session_factory(settings.resolved_database_url)()
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(session_dep)]
