"""What a job's stream holds, counted: its items by where they stand, the bytes a consume job's cap
weighs, and what a group's consumer may still be handed. Only SQL; each count is one statement, so it reads
one snapshot."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from hsx.server.db.models import WorkUnit
from hsx.server.db.stream_models import StreamConsumer, StreamItem
from hsx.server.jobs.repository import unit_lease_live
from hsx.server.streams.repository import item_lease_live


@dataclass(frozen=True)
class ItemCounts:
    """A job's items by where they stand, read in one statement (one snapshot, on every backend)."""

    ready: int  # committed, not acknowledged, not under a live lease
    leased: int
    acked: int
    ready_bytes: int
    leased_bytes: int
    unacked_bytes: int  # committed, not acknowledged
    stored_bytes: int  # committed, not deleted yet (acknowledged ones not deleted yet included)
    acked_stored_bytes: int  # acknowledged, not deleted yet
    largest_bytes: int  # the largest shard so far
    live_units: int  # work units held under a live lease (their shards are being written)


def item_counts(session: Session, job_id: str, now: float) -> ItemCounts:
    """Items of the job by where they stand, and the units in flight, in one statement: every count is
    of the same snapshot, so an acknowledgement committing meanwhile is counted once or not at all."""
    live = item_lease_live(now)
    unacked = StreamItem.acked_at.is_(None)
    stored = StreamItem.deleted_at.is_(None)
    live_units = (
        select(func.count())
        .select_from(WorkUnit)
        .where(WorkUnit.job_id == job_id, unit_lease_live(now))
        .scalar_subquery()
    )
    row = session.execute(
        select(
            func.count().filter(unacked),
            func.count().filter(live),
            func.count().filter(StreamItem.acked_at.is_not(None)),
            func.coalesce(func.sum(StreamItem.bytes).filter(unacked), 0),
            func.coalesce(func.sum(StreamItem.bytes).filter(live), 0),
            func.coalesce(func.sum(StreamItem.bytes).filter(stored), 0),
            func.coalesce(func.sum(StreamItem.bytes).filter(and_(stored, ~unacked)), 0),
            func.coalesce(func.max(StreamItem.bytes), 0),
            live_units,
        ).where(StreamItem.job_id == job_id)
    ).one()
    unacked_n, leased, acked, unacked_bytes, leased_bytes, stored_bytes, acked_stored, largest, units = (
        int(v or 0) for v in row
    )
    return ItemCounts(
        ready=unacked_n - leased,
        leased=leased,
        acked=acked,
        ready_bytes=unacked_bytes - leased_bytes,
        leased_bytes=leased_bytes,
        unacked_bytes=unacked_bytes,
        stored_bytes=stored_bytes,
        acked_stored_bytes=acked_stored,
        largest_bytes=largest,
        live_units=units,
    )


def buffered_bytes(session: Session, job_id: str) -> int:
    """Committed shard bytes not acknowledged yet."""
    return int(
        session.scalar(
            select(func.coalesce(func.sum(StreamItem.bytes), 0)).where(
                StreamItem.job_id == job_id, StreamItem.acked_at.is_(None)
            )
        )
        or 0
    )


def unacked_outside_group(session: Session, job_id: str, group_name: str, now: float) -> int:
    """Committed items neither acknowledged nor under a live lease of a consumer of this group: what a
    consumer of the group may still be handed (now, or once another reader's lease runs out). One
    statement, so under READ COMMITTED an acknowledgement committing meanwhile is seen on both sides of
    the subtraction or on neither."""
    group = select(StreamConsumer.id).where(
        StreamConsumer.job_id == job_id, StreamConsumer.group_name == group_name
    )
    unacked = StreamItem.acked_at.is_(None)
    held = and_(unacked, StreamItem.consumer_id.in_(group), item_lease_live(now))
    row = session.execute(
        select(func.count().filter(unacked), func.count().filter(held)).where(StreamItem.job_id == job_id)
    ).one()
    return int(row[0] or 0) - int(row[1] or 0)
