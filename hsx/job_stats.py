"""Read-only queries on the job table for operators: totals for ``/metrics``, a job's units and the leases
that show which workers and engines are busy. Only SQL lives here (the rules are in the callers)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from hsx.db.models import Job, JobState, Rejection, Shard, UnitState, WorkUnit


@dataclass(frozen=True)
class Totals:
    jobs_by_state: dict[str, int]
    samples_done: int
    samples_rejected: int
    tokens: int
    rejections_by_reason: dict[str, int]
    shards: int
    shard_bytes: int
    units_by_state: dict[str, int]
    live_leases: int


@dataclass(frozen=True)
class ActiveJob:
    id: str
    state: str
    samples_total: int
    samples_handled: int
    tokens: int
    started_at: datetime | None


@dataclass(frozen=True)
class UnitRow:
    unit_index: int
    state: str
    attempt: int
    sample_start: int
    sample_end: int
    samples_done: int
    samples_rejected: int
    tokens: int
    lease_owner: str | None
    lease_expires: float | None
    finished_at: datetime | None


@dataclass(frozen=True)
class LeaseRow:
    job_id: str
    unit_index: int
    attempt: int
    owner: str
    expires: float


def totals(session: Session, now: float) -> Totals:
    jobs_by_state = {s.value: 0 for s in JobState}
    for state, n in session.execute(select(Job.state, func.count()).group_by(Job.state)).all():
        jobs_by_state[state] = int(n)
    done, rejected, tokens = session.execute(
        select(
            func.coalesce(func.sum(Job.samples_done), 0),
            func.coalesce(func.sum(Job.samples_rejected), 0),
            func.coalesce(func.sum(Job.tokens_done), 0),
        )
    ).one()
    reasons = {
        reason: int(n)
        for reason, n in session.execute(
            select(Rejection.reason, func.count()).group_by(Rejection.reason)
        ).all()
    }
    shards, shard_bytes = session.execute(
        select(func.count(Shard.id), func.coalesce(func.sum(Shard.bytes), 0))
    ).one()
    units_by_state = {s.value: 0 for s in UnitState}
    for state, n in session.execute(select(WorkUnit.state, func.count()).group_by(WorkUnit.state)).all():
        units_by_state[state] = int(n)
    return Totals(
        jobs_by_state=jobs_by_state,
        samples_done=int(done),
        samples_rejected=int(rejected),
        tokens=int(tokens),
        rejections_by_reason=reasons,
        shards=int(shards),
        shard_bytes=int(shard_bytes),
        units_by_state=units_by_state,
        live_leases=len(live_leases(session, now)),
    )


def active_jobs(session: Session) -> list[ActiveJob]:
    rows = session.execute(
        select(
            Job.id,
            Job.state,
            Job.samples_total,
            Job.samples_done,
            Job.samples_rejected,
            Job.tokens_done,
            Job.started_at,
        ).where(Job.state.in_([JobState.queued.value, JobState.running.value]))
    ).all()
    return [
        ActiveJob(
            id=r[0],
            state=r[1],
            samples_total=int(r[2]),
            samples_handled=int(r[3]) + int(r[4]),
            tokens=int(r[5]),
            started_at=_aware(r[6]),
        )
        for r in rows
    ]


def units_of(session: Session, job_id: str) -> list[UnitRow]:
    units = session.scalars(
        select(WorkUnit).where(WorkUnit.job_id == job_id).order_by(WorkUnit.unit_index)
    ).all()
    return [
        UnitRow(
            unit_index=u.unit_index,
            state=u.state,
            attempt=u.attempt,
            sample_start=u.sample_start,
            sample_end=u.sample_end,
            samples_done=u.samples_done,
            samples_rejected=u.samples_rejected,
            tokens=int(u.tokens),
            lease_owner=u.lease_owner,
            lease_expires=u.lease_expires,
            finished_at=_aware(u.finished_at),
        )
        for u in units
    ]


def live_leases(session: Session, now: float, job_id: str | None = None) -> list[LeaseRow]:
    query = select(
        WorkUnit.job_id, WorkUnit.unit_index, WorkUnit.attempt, WorkUnit.lease_owner, WorkUnit.lease_expires
    ).where(WorkUnit.state == UnitState.leased.value, WorkUnit.lease_expires >= now)
    if job_id is not None:
        query = query.where(WorkUnit.job_id == job_id)
    return [
        LeaseRow(
            job_id=r[0], unit_index=int(r[1]), attempt=int(r[2]), owner=r[3] or "?", expires=float(r[4] or 0)
        )
        for r in session.execute(query.order_by(WorkUnit.job_id, WorkUnit.unit_index)).all()
    ]


def done_units_by_owner(session: Session, since: datetime | None = None) -> dict[str, int]:
    """Units committed per lease owner (``host:pid@engine_url``), optionally only since a time."""
    query = select(WorkUnit.lease_owner, func.count()).where(WorkUnit.state == UnitState.done.value)
    if since is not None:
        query = query.where(WorkUnit.finished_at >= since)
    return {owner or "?": int(n) for owner, n in session.execute(query.group_by(WorkUnit.lease_owner)).all()}


def _aware(value: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; every stored time is UTC.
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value
