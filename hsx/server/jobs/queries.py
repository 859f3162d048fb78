"""Every read-only query on the job table: the pages and counts behind the job document, the counts the
workers and the reconciler decide on, and the operators' views (``/metrics``, units, leases, engines).
Only SQL lives here; the rules are in the callers. Writes are in ``repository`` (a job and its units'
lifecycle) and ``recovery`` (failures and retries)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from hsx.layout import split_lease_owner
from hsx.server.db.models import Job, JobState, Rejection, Shard, Truncation, UnitState, WorkUnit
from hsx.server.db.stream_models import StreamItem
from hsx.server.jobs.repository import ACTIVE_STATES, LiveCounts, claimable, unit_lease_live

Row = TypeVar("Row")


@dataclass(frozen=True)
class Page(Generic[Row]):
    items: list[Row]
    total: int  # rows matching the query, over all pages


def paginate(session: Session, query: Select[Row], limit: int, offset: int) -> Page[Row]:
    """One page of an ordered query, and how many rows the whole query matches."""
    total = session.scalar(select(func.count()).select_from(query.order_by(None).subquery()))
    rows = session.scalars(query.limit(limit).offset(offset)).all()
    return Page(list(rows), int(total or 0))


@dataclass(frozen=True)
class FailedUnit:
    unit_index: int
    failures: int
    error: str | None


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
class UnitRow:
    """A unit as the fleet views show it (``GET /jobs/{id}/units`` validates its answer from this row)."""

    unit_index: int
    state: str
    attempt: int
    sample_start: int
    sample_end: int
    samples_done: int
    samples_rejected: int
    tokens: int
    lease_owner: str | None
    # Seconds until a live lease runs out; None when the unit is not held under one (read through
    # unit_lease_live, so a view and a claim never disagree on whether a lease holds).
    lease_seconds_left: float | None
    finished_at: datetime | None

    @property
    def worker(self) -> str | None:
        return split_lease_owner(self.lease_owner)[0]

    @property
    def engine(self) -> str | None:
        return split_lease_owner(self.lease_owner)[1]


@dataclass(frozen=True)
class LeaseRow:
    job_id: str
    unit_index: int
    attempt: int
    owner: str
    expires: float


def ping(session: Session) -> None:
    """Raises when the database does not answer."""
    session.execute(select(1))


# --- jobs ------------------------------------------------------------------------------------------------


def job_page(session: Session, state: str | None, limit: int, offset: int) -> Page[Job]:
    query = select(Job).order_by(Job.created_at.desc(), Job.id)
    if state is not None:
        query = query.where(Job.state == state)
    return paginate(session, query, limit, offset)


def job_state(session: Session, job_id: str) -> str | None:
    return session.scalar(select(Job.state).where(Job.id == job_id))


def active_jobs(session: Session, limit: int | None = None) -> list[Job]:
    """Queued and running jobs, oldest first."""
    query = select(Job).where(Job.state.in_(ACTIVE_STATES)).order_by(Job.created_at)
    return list(session.scalars(query if limit is None else query.limit(limit)).all())


def active_job_ids(session: Session) -> list[str]:
    return list(session.scalars(select(Job.id).where(Job.state.in_(ACTIVE_STATES))).all())


# --- a job's results: shards, rejections, truncations ---------------------------------------------------


def _shards_in_order(job_id: str) -> Select[Shard]:
    return (
        select(Shard)
        .join(WorkUnit, Shard.unit_id == WorkUnit.id)
        .where(Shard.job_id == job_id)
        .order_by(WorkUnit.unit_index)
    )


def list_shards(session: Session, job_id: str) -> list[Shard]:
    """All of a job's shards, in unit order."""
    return list(session.scalars(_shards_in_order(job_id)).all())


def unpublished_shards(session: Session, job_id: str, unit_id: int | None = None) -> list[Shard]:
    """Shards not yet confirmed in the job's object store (all, or one unit's), in unit order."""
    query = _shards_in_order(job_id).where(Shard.published_at.is_(None))
    if unit_id is not None:
        query = query.where(Shard.unit_id == unit_id)
    return list(session.scalars(query).all())


def shard_published(session: Session, shard_id: int) -> bool:
    return session.scalar(select(Shard.published_at).where(Shard.id == shard_id)) is not None


def shard_deleted(session: Session, shard_id: int) -> bool:
    """Whether the shard's item was acknowledged and its copies deleted (consume retention)."""
    return bool(
        session.scalar(
            select(func.count())
            .select_from(StreamItem)
            .where(StreamItem.shard_id == shard_id, StreamItem.deleted_at.is_not(None))
        )
    )


def shard_page(session: Session, job_id: str, limit: int, offset: int) -> Page[Shard]:
    return paginate(session, _shards_in_order(job_id), limit, offset)


def rejection_page(session: Session, job_id: str, limit: int, offset: int) -> Page[Rejection]:
    query = select(Rejection).where(Rejection.job_id == job_id).order_by(Rejection.sample_index)
    return paginate(session, query, limit, offset)


def rejection_counts(session: Session, job_id: str) -> dict[str, int]:
    rows = session.execute(
        select(Rejection.reason, func.count()).where(Rejection.job_id == job_id).group_by(Rejection.reason)
    ).all()
    return {reason: int(n) for reason, n in rows}


def truncation_page(session: Session, job_id: str, limit: int, offset: int) -> Page[Truncation]:
    query = select(Truncation).where(Truncation.job_id == job_id).order_by(Truncation.sample_index)
    return paginate(session, query, limit, offset)


# --- a job's units ----------------------------------------------------------------------------------------


def live_counts(session: Session, job_id: str, now: float) -> LiveCounts:
    """What the attempts holding live leases have handled so far (not yet committed)."""
    row = session.execute(
        select(
            func.coalesce(func.sum(WorkUnit.live_samples_done), 0),
            func.coalesce(func.sum(WorkUnit.live_samples_rejected), 0),
            func.coalesce(func.sum(WorkUnit.live_tokens), 0),
        ).where(WorkUnit.job_id == job_id, unit_lease_live(now))
    ).one()
    return LiveCounts(int(row[0]), int(row[1]), int(row[2]))


def unit_counts(session: Session, job_id: str) -> dict[str, int]:
    rows = session.execute(
        select(WorkUnit.state, func.count()).where(WorkUnit.job_id == job_id).group_by(WorkUnit.state)
    ).all()
    return {state: int(n) for state, n in rows}


def _count_units(session: Session, *where: Any) -> int:
    return int(session.scalar(select(func.count()).select_from(WorkUnit).where(*where)) or 0)


def live_lease_count(session: Session, job_id: str, now: float) -> int:
    return _count_units(session, WorkUnit.job_id == job_id, unit_lease_live(now))


def claimable_count(session: Session, job_id: str, now: float) -> int:
    return _count_units(session, WorkUnit.job_id == job_id, claimable(now))


def open_unit_count(session: Session, job_id: str) -> int:
    """Units not done (pending, leased or failed)."""
    return _count_units(session, WorkUnit.job_id == job_id, WorkUnit.state != UnitState.done.value)


def leased_units(session: Session, job_id: str) -> list[WorkUnit]:
    return list(
        session.scalars(
            select(WorkUnit).where(WorkUnit.job_id == job_id, WorkUnit.state == UnitState.leased.value)
        ).all()
    )


def failed_units(session: Session, job_id: str, limit: int = 20) -> list[FailedUnit]:
    rows = session.execute(
        select(WorkUnit.unit_index, WorkUnit.failures, WorkUnit.last_error)
        .where(WorkUnit.job_id == job_id, WorkUnit.state == UnitState.failed.value)
        .order_by(WorkUnit.unit_index)
        .limit(limit)
    ).all()
    return [FailedUnit(int(i), int(n), e) for i, n, e in rows]


def units_of(session: Session, job_id: str, now: float) -> list[UnitRow]:
    rows = session.execute(
        select(WorkUnit, unit_lease_live(now).label("lease_live"))
        .where(WorkUnit.job_id == job_id)
        .order_by(WorkUnit.unit_index)
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
            lease_seconds_left=round(float(u.lease_expires or 0) - now, 1) if live else None,
            finished_at=aware(u.finished_at),
        )
        for u, live in rows
    ]


# --- operators' views: totals, leases, engines -----------------------------------------------------------


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


def live_leases(session: Session, now: float, job_id: str | None = None) -> list[LeaseRow]:
    query = select(
        WorkUnit.job_id, WorkUnit.unit_index, WorkUnit.attempt, WorkUnit.lease_owner, WorkUnit.lease_expires
    ).where(unit_lease_live(now))
    if job_id is not None:
        query = query.where(WorkUnit.job_id == job_id)
    return [
        LeaseRow(
            job_id=r[0], unit_index=int(r[1]), attempt=int(r[2]), owner=r[3] or "?", expires=float(r[4] or 0)
        )
        for r in session.execute(query.order_by(WorkUnit.job_id, WorkUnit.unit_index)).all()
    ]


def done_units_by_owner(
    session: Session, job_id: str | None = None, since: datetime | None = None
) -> dict[str, int]:
    """Units committed per lease owner (``host:pid@engine_url``), of one job or all, optionally only
    since a time."""
    query = select(WorkUnit.lease_owner, func.count()).where(WorkUnit.state == UnitState.done.value)
    if job_id is not None:
        query = query.where(WorkUnit.job_id == job_id)
    if since is not None:
        query = query.where(WorkUnit.finished_at >= since)
    return {owner or "?": int(n) for owner, n in session.execute(query.group_by(WorkUnit.lease_owner)).all()}


def done_units_by_engine(session: Session, job_id: str) -> dict[str, int]:
    """Units of a job committed per engine: the engine is the lease owner's part after ``@``."""
    counts: dict[str, int] = {}
    for owner, n in done_units_by_owner(session, job_id).items():
        engine = split_lease_owner(owner)[1] or owner
        counts[engine] = counts.get(engine, 0) + n
    return counts


def aware(value: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; every stored time is UTC.
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value
