"""Read-only queries behind the job document and readiness: what units at work have handled so far, the
truncated samples, the active jobs. Only SQL lives here."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from hsx.db.models import Job, Truncation, UnitState, WorkUnit
from hsx.jobs.repository import ACTIVE_STATES, LiveCounts


def active_jobs(session: Session, limit: int = 100) -> list[Job]:
    return list(
        session.scalars(
            select(Job).where(Job.state.in_(ACTIVE_STATES)).order_by(Job.created_at).limit(limit)
        ).all()
    )


def list_truncations(session: Session, job_id: str, limit: int, offset: int) -> tuple[list[Truncation], int]:
    rows = session.scalars(
        select(Truncation)
        .where(Truncation.job_id == job_id)
        .order_by(Truncation.sample_index)
        .limit(limit)
        .offset(offset)
    ).all()
    total = session.scalar(select(func.count()).select_from(Truncation).where(Truncation.job_id == job_id))
    return list(rows), int(total or 0)


def live_counts(session: Session, job_id: str, now: float) -> LiveCounts:
    """What the attempts holding live leases have handled so far (not yet committed)."""
    row = session.execute(
        select(
            func.coalesce(func.sum(WorkUnit.live_samples_done), 0),
            func.coalesce(func.sum(WorkUnit.live_samples_rejected), 0),
            func.coalesce(func.sum(WorkUnit.live_tokens), 0),
        ).where(
            WorkUnit.job_id == job_id,
            WorkUnit.state == UnitState.leased.value,
            WorkUnit.lease_expires >= now,
        )
    ).one()
    return LiveCounts(int(row[0]), int(row[1]), int(row[2]))
