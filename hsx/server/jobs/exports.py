"""The exports table's queries: the API records and reads exports, the worker that makes one moves it
through its states. Each function runs in the caller's transaction; the caller commits."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from hsx.server.db.base import utcnow
from hsx.server.db.export_models import Export

ACTIVE_STATES = ("queued", "running")


def add(
    session: Session, export_id: str, job_id: str, fmt: str, options: dict[str, Any], dest: str
) -> Export:
    row = Export(
        id=export_id, job_id=job_id, format=fmt, options=options, dest=dest, state="queued", attempts=0
    )
    session.add(row)
    session.flush()
    return row


def get(session: Session, job_id: str, export_id: str) -> Export | None:
    row = session.get(Export, export_id)
    return row if row is not None and row.job_id == job_id else None


def of_job(session: Session, job_id: str) -> list[Export]:
    """A job's exports, newest first."""
    query = select(Export).where(Export.job_id == job_id).order_by(Export.created_at.desc(), Export.id)
    return list(session.scalars(query))


def same_export(session: Session, job_id: str, fmt: str, options: dict[str, Any]) -> Export | None:
    """The export a new request for these format and options would repeat: one not failed."""
    for row in of_job(session, job_id):
        if row.format == fmt and row.options == options and row.state != "failed":
            return row
    return None


def start(session: Session, export_id: str) -> Export | None:
    """The row, locked, moved to running with one more attempt; None when it is gone or already done."""
    row = session.scalars(select(Export).where(Export.id == export_id).with_for_update()).first()
    if row is None or row.state == "succeeded":
        return row
    row.state, row.error, row.attempts, row.updated_at = "running", None, row.attempts + 1, utcnow()
    return row


def finish(
    session: Session,
    export_id: str,
    *,
    report: dict[str, Any] | None = None,
    error: dict[str, str] | None = None,
) -> None:
    """Succeeded with its report, or failed with ``{"error", "detail"}``."""
    row = session.get(Export, export_id)
    if row is None:
        return
    row.state = "failed" if error else "succeeded"
    row.error, row.report, row.updated_at = error, report, utcnow()


def requeue(session: Session, export_id: str) -> None:
    row = session.get(Export, export_id)
    if row is not None:
        row.state, row.updated_at = "queued", utcnow()
