"""Writes on the job table: a job's row (submit, prepare, state) and who holds which of its units (claim,
lease, release), and the look-ups by key they start from. No rules live here, only SQL. A unit's results
are recorded by ``unit_results``; read-only queries are in ``queries``; failures and retries in
``recovery``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, insert, or_, select, update
from sqlalchemy.orm import Session

from hsx.server.db.models import Job, JobState, UnitState, WorkUnit, utcnow

ACTIVE_STATES = (JobState.queued.value, JobState.running.value)
# A fresh attempt starts with nothing handled (a claim, a release and a commit all reset the live counts).
NO_LIVE_COUNTS: dict[str, Any] = {"live_samples_done": 0, "live_samples_rejected": 0, "live_tokens": 0}


@dataclass(frozen=True)
class ClaimedUnit:
    id: int
    job_id: str
    unit_index: int
    sample_start: int
    sample_end: int
    attempt: int
    owner: str
    byte_start: int | None = None
    byte_end: int | None = None
    # A retry unit's samples (its range holds others, already committed or rejected for good).
    sample_indices: tuple[int, ...] | None = None
    # The unit whose rejections a retry unit re-runs; they are replaced when this one commits.
    source_unit_id: int | None = None

    def holds(self, sample_index: int) -> bool:
        return self.sample_indices is None or sample_index in self.sample_indices


@dataclass(frozen=True)
class LiveCounts:
    """What an attempt has handled so far, shown before it commits."""

    samples_done: int
    samples_rejected: int
    tokens: int


# --- jobs -----------------------------------------------------------------------------------------------


def add_job(session: Session, job: Job) -> None:
    """A job as submitted: its units are created when a worker prepares it (``record_prepared``)."""
    session.add(job)
    session.flush()


def begin_prepare(session: Session, job_id: str, owner: str, lease_seconds: float, now: float) -> bool:
    """Take the lease on preparing a queued job that has no units yet; False when another worker holds it
    or the job is past that step."""
    result = session.execute(
        update(Job)
        .where(
            Job.id == job_id,
            Job.state == JobState.queued.value,
            Job.units_total == 0,
            or_(Job.prepare_expires.is_(None), Job.prepare_expires < now, Job.prepare_owner == owner),
        )
        .values(prepare_owner=owner, prepare_expires=now + lease_seconds)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def record_prepared(
    session: Session,
    job_id: str,
    owner: str,
    records_path: str,
    records_bytes: int,
    units: Sequence[tuple[int, int, int, int]],
    projection: dict[str, Any] | None = None,
) -> bool:
    """Store the prepared records (and the output's projected size) and create the units
    ``(sample_start, sample_end, byte_start, byte_end)``, fenced on the prepare lease; False (nothing
    written) when the lease was lost."""
    samples = units[-1][1] if units else 0
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.prepare_owner == owner, Job.units_total == 0)
        .values(
            records_path=records_path,
            records_bytes=records_bytes,
            samples_total=samples,
            units_total=len(units),
            prepare_expires=None,
            projection=projection,
            updated_at=utcnow(),
        )
        .execution_options(synchronize_session=False)
    )
    if not result.rowcount:  # type: ignore[attr-defined]
        return False
    if units:
        session.execute(
            insert(WorkUnit),
            [
                {
                    "job_id": job_id,
                    "unit_index": i,
                    "sample_start": s0,
                    "sample_end": s1,
                    "byte_start": b0,
                    "byte_end": b1,
                    "state": UnitState.pending.value,
                    "attempt": 0,
                    "samples_done": 0,
                    "samples_rejected": 0,
                    "samples_truncated": 0,
                    "tokens": 0,
                    "failures": 0,
                    "live_samples_done": 0,
                    "live_samples_rejected": 0,
                    "live_tokens": 0,
                }
                for i, (s0, s1, b0, b1) in enumerate(units)
            ],
        )
    return True


def get_job(session: Session, job_id: str) -> Job | None:
    return session.get(Job, job_id)


def get_job_by_idempotency_key(session: Session, key: str) -> Job | None:
    return session.scalars(select(Job).where(Job.idempotency_key == key)).first()


def set_job_state(
    session: Session, job_id: str, new_state: JobState, from_states: Sequence[str], **values: Any
) -> bool:
    """Compare-and-set a job's state; returns whether this caller made the transition."""
    stamp: dict[str, Any] = {"updated_at": utcnow()}
    if new_state == JobState.running:
        stamp["started_at"] = utcnow()
    if new_state.is_final:
        stamp["finished_at"] = utcnow()
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state.in_(list(from_states)))
        .values(state=new_state.value, **stamp, **values)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


# --- work units and leases --------------------------------------------------------------------------------


def unit_lease_live(now: float) -> Any:
    """A unit held under a lease that has not run out: the one SQL statement of unit liveness (claims,
    heartbeats, commits, counts and views all read it)."""
    return and_(WorkUnit.state == UnitState.leased.value, WorkUnit.lease_expires >= now)


def claimable(now: float) -> Any:
    """Pending, or leased under a lease that ran out."""
    return or_(
        WorkUnit.state == UnitState.pending.value,
        and_(WorkUnit.state == UnitState.leased.value, ~unit_lease_live(now)),
    )


def claim_unit(
    session: Session, job_id: str, owner: str, lease_seconds: float, now: float
) -> ClaimedUnit | None:
    """Lease the first claimable unit of a job. A compare-and-set on (state, attempt) makes two claimers
    that read the same row race safely on every backend, SQLite included."""
    for _ in range(20):
        row = session.execute(
            select(WorkUnit.id, WorkUnit.attempt, WorkUnit.state)
            .where(WorkUnit.job_id == job_id, claimable(now))
            .order_by(WorkUnit.unit_index)
            .limit(1)
            .with_for_update(skip_locked=True)
        ).first()
        if row is None:
            return None
        unit_id, attempt, state = row
        result = session.execute(
            update(WorkUnit)
            .where(WorkUnit.id == unit_id, WorkUnit.attempt == attempt, WorkUnit.state == state)
            .values(
                state=UnitState.leased.value,
                attempt=attempt + 1,
                lease_owner=owner,
                lease_expires=now + lease_seconds,
                **NO_LIVE_COUNTS,
            )
            .execution_options(synchronize_session=False)
        )
        if result.rowcount:  # type: ignore[attr-defined]
            unit = session.get(WorkUnit, unit_id)
            assert unit is not None
            session.refresh(unit)
            return ClaimedUnit(
                unit.id,
                unit.job_id,
                unit.unit_index,
                unit.sample_start,
                unit.sample_end,
                unit.attempt,
                owner,
                unit.byte_start,
                unit.byte_end,
                None if unit.sample_indices is None else tuple(unit.sample_indices),
                unit.parent_unit_id,
            )
    return None


def held(unit: ClaimedUnit, now: float) -> Any:
    return and_(
        WorkUnit.id == unit.id,
        WorkUnit.attempt == unit.attempt,
        WorkUnit.lease_owner == unit.owner,
        unit_lease_live(now),
    )


def extend_lease(
    session: Session, unit: ClaimedUnit, lease_seconds: float, now: float, live: LiveCounts | None = None
) -> bool:
    """A heartbeat: succeeds only while this attempt still holds an unexpired lease. ``live`` is what the
    attempt has handled so far (shown in the job's progress until the unit commits)."""
    values: dict[str, Any] = {"lease_expires": now + lease_seconds}
    if live is not None:
        values.update(
            live_samples_done=live.samples_done,
            live_samples_rejected=live.samples_rejected,
            live_tokens=live.tokens,
        )
    result = session.execute(
        update(WorkUnit).where(held(unit, now)).values(**values).execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def release_unit(session: Session, unit: ClaimedUnit) -> bool:
    """Give a unit back untouched (graceful shutdown): the next claim takes it at once."""
    result = session.execute(
        update(WorkUnit)
        .where(
            WorkUnit.id == unit.id, WorkUnit.attempt == unit.attempt, WorkUnit.state == UnitState.leased.value
        )
        .values(state=UnitState.pending.value, lease_owner=None, lease_expires=None, **NO_LIVE_COUNTS)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def expire_leases_owned_by(session: Session, owner: str) -> int:
    result = session.execute(
        update(WorkUnit)
        .where(WorkUnit.lease_owner == owner, WorkUnit.state == UnitState.leased.value)
        .values(lease_expires=0.0)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]
