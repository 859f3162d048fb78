"""Queries for units that fail and jobs that are run again. Only SQL and the bookkeeping it needs; when a
failure is counted, when a job may be retried and what is retriable are decided by the callers.

* A unit's attempt that ends in an error counts a failure on the unit; at the bound the unit is ``failed``
  and its job fails with the unit's reason. Each write is fenced on the attempt that holds the lease.
* A retry makes failed units pending again, and turns the retriable rejections of each unit into a *retry
  unit*: the same byte range, only those samples, its own shard. The rejection rows stay until that unit
  commits, which deletes them in the commit that publishes the samples (``repository.commit_unit``), so a
  sample is never both published and rejected, nor published twice.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from hsx.server.db.models import Job, JobState, Rejection, UnitState, WorkUnit, utcnow
from hsx.server.jobs.repository import ClaimedUnit, held

ERROR_CHARS = 2000


@dataclass(frozen=True)
class FailureCount:
    recorded: bool  # False: the attempt no longer held the unit, nothing was written
    failures: int
    unit_failed: bool  # the bound was reached: the unit is failed, and so is its job


def job_error_for(unit_index: int, failures: int, reason: str) -> str:
    return f"unit {unit_index} failed {failures} time(s); last: {reason}"[:ERROR_CHARS]


def count_unit_failure(session: Session, unit: ClaimedUnit, reason: str, max_failures: int) -> FailureCount:
    """This attempt ended in ``reason``: count it on the unit and give the unit back (pending), or, at
    ``max_failures``, fail the unit and its job. Only while this attempt still holds the unit."""
    row = session.execute(
        select(WorkUnit.failures)
        .where(
            WorkUnit.id == unit.id,
            WorkUnit.attempt == unit.attempt,
            WorkUnit.lease_owner == unit.owner,
            WorkUnit.state == UnitState.leased.value,
        )
        .with_for_update()
    ).first()
    if row is None:
        return FailureCount(False, 0, False)
    failures = int(row[0]) + 1
    failed = failures >= max_failures
    _end_attempt(session, unit.id, failures, reason, failed)
    if failed:
        _fail_job(session, unit.job_id, job_error_for(unit.unit_index, failures, reason))
    return FailureCount(True, failures, failed)


def fail_unit_and_job(session: Session, unit: ClaimedUnit, reason: str, now: float) -> bool:
    """A failure that no retry heals (the dataset is gone, the disk is full, no tokenizer): the unit fails
    and the job with it, only while this attempt holds an unexpired lease. False: it did not."""
    row = session.execute(select(WorkUnit.failures).where(held(unit, now)).with_for_update()).first()
    if row is None:
        return False
    _end_attempt(session, unit.id, int(row[0]) + 1, reason, True)
    _fail_job(session, unit.job_id, reason[:ERROR_CHARS])
    return True


def fail_preparing_job(session: Session, job_id: str, owner: str, reason: str) -> bool:
    """The dataset could not be prepared (or the output would not fit): the job fails, only while
    ``owner`` holds the prepare lease."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == JobState.queued.value, Job.prepare_owner == owner)
        .values(
            state=JobState.failed.value,
            error=reason[:ERROR_CHARS],
            prepare_expires=None,
            finished_at=utcnow(),
            updated_at=utcnow(),
        )
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def count_dead_owner_failures(
    session: Session, owner: str, reason: str, max_failures: int
) -> list[tuple[str, int, bool]]:
    """A work horse died holding these leases: each unit counts a failure and is claimable at once (or
    fails, with its job, at the bound). Returns ``(job_id, unit_index, unit_failed)`` per unit."""
    units = session.execute(
        select(WorkUnit.id, WorkUnit.job_id, WorkUnit.unit_index, WorkUnit.failures)
        .where(WorkUnit.lease_owner == owner, WorkUnit.state == UnitState.leased.value)
        .with_for_update()
    ).all()
    out: list[tuple[str, int, bool]] = []
    for unit_id, job_id, unit_index, failures in units:
        count = int(failures) + 1
        failed = count >= max_failures
        _end_attempt(session, unit_id, count, reason, failed)
        if failed:
            _fail_job(session, job_id, job_error_for(unit_index, count, reason))
        out.append((job_id, unit_index, failed))
    return out


def _end_attempt(session: Session, unit_id: int, failures: int, reason: str, failed: bool) -> None:
    values: dict[str, object] = {
        "state": UnitState.failed.value if failed else UnitState.pending.value,
        "failures": failures,
        "last_error": reason[:ERROR_CHARS],
        "lease_owner": None,
        "lease_expires": None,
        "live_samples_done": 0,
        "live_samples_rejected": 0,
        "live_tokens": 0,
    }
    session.execute(
        update(WorkUnit)
        .where(WorkUnit.id == unit_id)
        .values(**values)
        .execution_options(synchronize_session=False)
    )


def _fail_job(session: Session, job_id: str, error: str) -> bool:
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state.in_([JobState.queued.value, JobState.running.value]))
        .values(state=JobState.failed.value, error=error, finished_at=utcnow(), updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


# --- running a finished job again ------------------------------------------------------------------------


def reopen_job(session: Session, job_id: str, from_states: Collection[str], prepared: bool) -> bool:
    """Compare-and-set a finished job back to work: ``running`` when its units exist, ``queued`` (to be
    prepared again) when it failed before they did. The row lock it takes serializes concurrent retries."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state.in_(list(from_states)))
        .values(
            state=JobState.running.value if prepared else JobState.queued.value,
            error=None,
            finished_at=None,
            prepare_owner=None,
            prepare_expires=None,
            updated_at=utcnow(),
        )
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def reopen_failed_units(session: Session, job_id: str) -> int:
    result = session.execute(
        update(WorkUnit)
        .where(WorkUnit.job_id == job_id, WorkUnit.state == UnitState.failed.value)
        .values(state=UnitState.pending.value, failures=0, lease_owner=None, lease_expires=None)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def retriable_rejections(session: Session, job_id: str, reasons: Collection[str]) -> dict[int, list[int]]:
    """Sample indices of the retriable rejections no retry unit has taken yet, by the unit that holds them."""
    rows = session.execute(
        select(Rejection.unit_id, Rejection.sample_index)
        .where(
            Rejection.job_id == job_id,
            Rejection.reason.in_(list(reasons)),
            Rejection.retry_unit_id.is_(None),
        )
        .order_by(Rejection.unit_id, Rejection.sample_index)
    ).all()
    groups: dict[int, list[int]] = {}
    for unit_id, sample_index in rows:
        groups.setdefault(int(unit_id), []).append(int(sample_index))
    return groups


def add_retry_units(session: Session, job_id: str, groups: dict[int, list[int]]) -> int:
    """One retry unit per source unit, re-running ``groups[source_unit_id]``; returns how many were added."""
    if not groups:
        return 0
    last_index = session.scalar(select(func.max(WorkUnit.unit_index)).where(WorkUnit.job_id == job_id))
    next_index = 0 if last_index is None else int(last_index) + 1
    sources = {u.id: u for u in session.scalars(select(WorkUnit).where(WorkUnit.id.in_(list(groups)))).all()}
    for offset, (source_id, indices) in enumerate(sorted(groups.items())):
        source = sources[source_id]
        retry = WorkUnit(
            job_id=job_id,
            unit_index=next_index + offset,
            sample_start=source.sample_start,
            sample_end=source.sample_end,
            byte_start=source.byte_start,
            byte_end=source.byte_end,
            state=UnitState.pending.value,
            attempt=0,
            samples_done=0,
            samples_rejected=0,
            samples_truncated=0,
            tokens=0,
            failures=0,
            live_samples_done=0,
            live_samples_rejected=0,
            live_tokens=0,
            sample_indices=list(indices),
            parent_unit_id=source_id,
        )
        session.add(retry)
        session.flush()
        session.execute(
            update(Rejection)
            .where(
                Rejection.job_id == job_id,
                Rejection.unit_id == source_id,
                Rejection.sample_index.in_(indices),
                Rejection.retry_unit_id.is_(None),
            )
            .values(retry_unit_id=retry.id)
            .execution_options(synchronize_session=False)
        )
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(units_total=Job.units_total + len(groups), updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    return len(groups)
