"""Writes on the job table that record a unit's results: the fenced commit of its shard, rejections and
truncations with the hooks that commit with them, and what is asked of a commit afterwards (did it land; is
its shard in the object store). No rules live here, only SQL."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from hsx.server.db.models import Job, Rejection, Shard, Truncation, UnitState, WorkUnit, utcnow
from hsx.server.jobs.repository import NO_LIVE_COUNTS, ClaimedUnit, held


@dataclass(frozen=True)
class RejectionRow:
    sample_index: int
    reason: str
    detail: str
    record_id: str | None = None


@dataclass(frozen=True)
class TruncationRow:
    sample_index: int
    tokens: int  # before the cut
    kept: int
    record_id: str | None = None


@dataclass(frozen=True)
class ShardRow:
    path: str
    sha256: str
    bytes: int
    samples: int
    tokens: int
    header_sha256: str | None = None


@dataclass(frozen=True)
class CommittedUnit:
    """What a commit hook is told of the unit being committed: the attempt, and its shard with the shard's
    row id (both None for a unit that published no sample)."""

    unit: ClaimedUnit
    shard: ShardRow | None
    shard_id: int | None


# Runs inside a unit's commit transaction, after its results are written: what it writes commits with the
# unit or not at all, and an exception it raises rolls the whole commit back.
CommitHook = Callable[[Session, CommittedUnit], None]


def unit_committed_by(session: Session, unit: ClaimedUnit) -> bool:
    """After an ambiguous commit (connection lost), tells whether this attempt's commit landed."""
    row = session.execute(select(WorkUnit.state, WorkUnit.attempt).where(WorkUnit.id == unit.id)).first()
    return row is not None and row[0] == UnitState.done.value and row[1] == unit.attempt


def mark_published(session: Session, shard_id: int, now: float) -> bool:
    """Record that a shard is confirmed in the object store; False when another publisher did first."""
    result = session.execute(
        update(Shard)
        .where(Shard.id == shard_id, Shard.published_at.is_(None))
        .values(published_at=now)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def commit_unit(
    session: Session,
    unit: ClaimedUnit,
    now: float,
    shard: ShardRow | None,
    rejections: Sequence[RejectionRow],
    samples_done: int,
    tokens: int,
    place: Callable[[], None],
    truncations: Sequence[TruncationRow] = (),
    hooks: Sequence[CommitHook] = (),
) -> bool:
    """Record a unit's results once. The fenced UPDATE both checks that this attempt still owns an unexpired
    lease and takes the row's write lock, so ``place`` (the shard's rename into place) runs while no
    other attempt can commit. Returns False, writing nothing, when the lease was lost.

    A retry unit replaces the rejections of the samples it re-ran in this same transaction: a sample is
    never both kept and rejected, and never kept twice. ``hooks`` run last, in the same
    transaction (:data:`CommitHook`)."""
    result = session.execute(
        update(WorkUnit)
        .where(held(unit, now))
        .values(
            state=UnitState.done.value,
            lease_expires=None,
            samples_done=samples_done,
            samples_rejected=len(rejections),
            samples_truncated=len(truncations),
            tokens=tokens,
            finished_at=utcnow(),
            **NO_LIVE_COUNTS,
        )
        .execution_options(synchronize_session=False)
    )
    if not result.rowcount:  # type: ignore[attr-defined]
        return False
    replaced = _take_back_rejections(session, unit)
    place()
    shard_row = None
    if shard is not None:
        shard_row = Shard(
            job_id=unit.job_id,
            unit_id=unit.id,
            key=f"{unit.job_id}/{unit.unit_index}",
            path=shard.path,
            sha256=shard.sha256,
            header_sha256=shard.header_sha256,
            bytes=shard.bytes,
            samples=shard.samples,
            tokens=shard.tokens,
        )
        session.add(shard_row)
        session.flush()  # its id, for the hooks
    session.add_all(
        Rejection(
            job_id=unit.job_id,
            unit_id=unit.id,
            sample_index=r.sample_index,
            reason=r.reason[:64],
            detail=r.detail,
            record_id=r.record_id,
        )
        for r in rejections
    )
    session.add_all(
        Truncation(
            job_id=unit.job_id,
            unit_id=unit.id,
            sample_index=t.sample_index,
            record_id=t.record_id,
            tokens=t.tokens,
            kept=t.kept,
        )
        for t in truncations
    )
    session.execute(
        update(Job)
        .where(Job.id == unit.job_id)
        .values(
            samples_done=Job.samples_done + samples_done,
            samples_rejected=Job.samples_rejected + len(rejections) - replaced,
            samples_truncated=Job.samples_truncated + len(truncations),
            tokens_done=Job.tokens_done + tokens,
            bytes_written=Job.bytes_written + (shard.bytes if shard is not None else 0),
            units_done=Job.units_done + 1,
            updated_at=utcnow(),
        )
        .execution_options(synchronize_session=False)
    )
    committed = CommittedUnit(unit, shard, None if shard_row is None else shard_row.id)
    for hook in hooks:
        hook(session, committed)
    return True


def _take_back_rejections(session: Session, unit: ClaimedUnit) -> int:
    """A retry unit's commit: delete the rejections it re-ran (they are re-recorded from its results) and
    take them off the counts of the unit that recorded them. Returns how many."""
    if unit.sample_indices is None or unit.source_unit_id is None:
        return 0
    taken = session.execute(
        delete(Rejection)
        .where(Rejection.job_id == unit.job_id, Rejection.retry_unit_id == unit.id)
        .execution_options(synchronize_session=False)
    )
    count = int(taken.rowcount)  # type: ignore[attr-defined]
    if count:
        session.execute(
            update(WorkUnit)
            .where(WorkUnit.id == unit.source_unit_id)
            .values(samples_rejected=WorkUnit.samples_rejected - count)
            .execution_options(synchronize_session=False)
        )
    return count
