"""SQL on the regenerated samples: the fenced write of a unit's generated conversations, their read-back
by the unit's later attempts, the job's totals and the download. No rules here."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session

from hsx.server.db.models import WorkUnit
from hsx.server.db.regenerate_models import RegeneratedSample
from hsx.server.jobs.repository import ClaimedUnit, held


@dataclass(frozen=True)
class KeptSample:
    """One sample's outcome as recorded: a kept conversation, or the reason it could not be regenerated."""

    sample_index: int
    record_id: str | None
    reason: str | None = None
    detail: str = ""
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    generated_tokens: int = 0
    turns_generated: int = 0
    turns_at_length: int = 0
    generation: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, row: RegeneratedSample) -> KeptSample:
        return cls(
            row.sample_index,
            row.record_id,
            row.reason,
            row.detail,
            row.messages,
            row.input_ids,
            row.loss_mask,
            row.generated_tokens,
            row.turns_generated,
            row.turns_at_length,
            dict(row.generation or {}),
        )


def kept_samples(session: Session, job_id: str, indices: Sequence[int]) -> dict[int, KeptSample]:
    """The recorded outcomes of these samples of the job, by sample index."""
    if not indices:
        return {}
    rows = session.scalars(
        select(RegeneratedSample).where(
            RegeneratedSample.job_id == job_id,
            RegeneratedSample.sample_index >= min(indices),
            RegeneratedSample.sample_index <= max(indices),
        )
    )
    wanted = set(indices)
    return {row.sample_index: KeptSample.of(row) for row in rows if row.sample_index in wanted}


def keep_samples(session: Session, unit: ClaimedUnit, now: float, samples: Sequence[KeptSample]) -> bool:
    """Record ``samples`` for ``unit``, only while this attempt holds an unexpired lease: the fenced UPDATE
    takes the unit row's write lock, so no other attempt can write in between. False, writing nothing,
    when the lease is lost."""
    fenced = session.execute(
        update(WorkUnit)
        .where(held(unit, now))
        .values(lease_expires=WorkUnit.lease_expires)
        .execution_options(synchronize_session=False)
    )
    if not fenced.rowcount:  # type: ignore[attr-defined]
        return False
    session.add_all(
        RegeneratedSample(
            job_id=unit.job_id,
            unit_id=unit.id,
            attempt=unit.attempt,
            sample_index=s.sample_index,
            record_id=s.record_id,
            reason=s.reason[:64] if s.reason else None,
            detail=s.detail,
            messages=s.messages,
            input_ids=s.input_ids,
            loss_mask=s.loss_mask,
            generated_tokens=s.generated_tokens,
            turns_generated=s.turns_generated,
            turns_at_length=s.turns_at_length,
            generation=s.generation,
        )
        for s in samples
    )
    return True


@dataclass(frozen=True)
class RegenerateTotals:
    samples_kept: int
    samples_failed: int
    generated_tokens: int
    turns_generated: int
    turns_at_length: int


def totals(session: Session, job_id: str) -> RegenerateTotals:
    row = session.execute(
        select(
            func.coalesce(func.sum(case((RegeneratedSample.reason.is_(None), 1), else_=0)), 0),
            func.count(RegeneratedSample.reason),
            func.coalesce(func.sum(RegeneratedSample.generated_tokens), 0),
            func.coalesce(func.sum(RegeneratedSample.turns_generated), 0),
            func.coalesce(func.sum(RegeneratedSample.turns_at_length), 0),
        ).where(RegeneratedSample.job_id == job_id)
    ).one()
    return RegenerateTotals(*(int(value or 0) for value in row))


def generated_tokens_by_job(session: Session, job_ids: Sequence[str]) -> dict[str, int]:
    """Tokens generated for the kept texts of each of these jobs (jobs without any are left out)."""
    if not job_ids:
        return {}
    rows = session.execute(
        select(RegeneratedSample.job_id, func.sum(RegeneratedSample.generated_tokens))
        .where(RegeneratedSample.job_id.in_(list(job_ids)))
        .group_by(RegeneratedSample.job_id)
    )
    return {job_id: int(tokens or 0) for job_id, tokens in rows}


def kept_in_order(session: Session, job_id: str, batch: int = 500) -> Iterator[KeptSample]:
    """Every kept conversation of the job in sample order, read ``batch`` rows at a time (keyset)."""
    after = -1
    while True:
        rows = list(
            session.scalars(
                select(RegeneratedSample)
                .where(
                    RegeneratedSample.job_id == job_id,
                    RegeneratedSample.reason.is_(None),
                    RegeneratedSample.sample_index > after,
                )
                .order_by(RegeneratedSample.sample_index)
                .limit(batch)
            )
        )
        if not rows:
            return
        for row in rows:
            yield KeptSample.of(row)
        after = rows[-1].sample_index
