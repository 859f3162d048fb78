"""Queries on the stream tables. No rules live here, only SQL."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, exists, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from hsx.db.models import Job, Shard, UnitState, WorkUnit
from hsx.streams.models import StreamConsumer, StreamItem


@dataclass(frozen=True)
class LeasedItem:
    id: int
    delivery: int
    unit_index: int
    lease_expires: float
    path: str
    sha256: str
    bytes: int
    samples: int
    tokens: int
    header_sha256: str | None
    uri: str | None = None  # where the shard is in the job's object store, when the job publishes there


@dataclass(frozen=True)
class ItemCounts:
    ready: int  # committed, not acknowledged, not under a live lease
    leased: int
    acked: int
    ready_bytes: int
    leased_bytes: int


def add_consumer(session: Session, consumer: StreamConsumer) -> None:
    session.add(consumer)


def get_consumer(session: Session, job_id: str, consumer_id: str) -> StreamConsumer | None:
    consumer = session.get(StreamConsumer, consumer_id)
    return consumer if consumer is not None and consumer.job_id == job_id else None


def list_consumers(session: Session, job_id: str) -> list[StreamConsumer]:
    return list(
        session.scalars(
            select(StreamConsumer).where(StreamConsumer.job_id == job_id).order_by(StreamConsumer.created_at)
        ).all()
    )


def touch_consumer(session: Session, consumer_id: str, now: float) -> None:
    session.execute(
        update(StreamConsumer)
        .where(StreamConsumer.id == consumer_id)
        .values(last_seen=now)
        .execution_options(synchronize_session=False)
    )


def add_missing_items(session: Session, job_id: str) -> None:
    """An item for every committed shard of the job that has none yet. Idempotent and race-safe: the
    unique shard_id makes a concurrent insert of the same item a no-op."""
    source = (
        select(Shard.job_id, Shard.id, WorkUnit.unit_index, Shard.bytes)
        .join(WorkUnit, Shard.unit_id == WorkUnit.id)
        .where(Shard.job_id == job_id, ~exists().where(StreamItem.shard_id == Shard.id))
    )
    columns = ["job_id", "shard_id", "unit_index", "bytes"]
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(
        insert(StreamItem).from_select(columns, source).on_conflict_do_nothing(index_elements=["shard_id"])
    )


def _leasable(now: float) -> ColumnElement[bool]:
    return and_(
        StreamItem.acked_at.is_(None),
        or_(StreamItem.consumer_id.is_(None), StreamItem.lease_expires < now),
    )


def _published() -> ColumnElement[bool]:
    return exists().where(Shard.id == StreamItem.shard_id, Shard.published_at.is_not(None))


def lease_items(
    session: Session,
    job_id: str,
    consumer_id: str,
    limit: int,
    lease_seconds: float,
    now: float,
    published_only: bool = False,
) -> list[LeasedItem]:
    """Lease up to ``limit`` items in unit order: committed, unacknowledged, under no live lease (and, with
    ``published_only``, confirmed in the object store). Each lease is a compare-and-set on the item's
    delivery, so two consumers never both win one item."""
    candidates = session.execute(
        select(StreamItem.id, StreamItem.delivery)
        .where(StreamItem.job_id == job_id, _leasable(now), *([_published()] if published_only else []))
        .order_by(StreamItem.unit_index)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()
    won: list[int] = []
    for item_id, delivery in candidates:
        result = session.execute(
            update(StreamItem)
            .where(StreamItem.id == item_id, StreamItem.delivery == delivery, _leasable(now))
            .values(delivery=delivery + 1, consumer_id=consumer_id, lease_expires=now + lease_seconds)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount:  # type: ignore[attr-defined]
            won.append(item_id)
    return leased_items(session, won)


def held_unseen(
    session: Session,
    job_id: str,
    consumer_id: str,
    seen: set[tuple[int, int]],
    limit: int,
    lease_seconds: float,
    now: float,
) -> list[LeasedItem]:
    """Deliveries this consumer holds under a live lease that it says it never received (the answer of the
    lease call that took them was lost): handed back as the same delivery, their lease renewed from now."""
    held = session.execute(
        select(StreamItem.id, StreamItem.delivery)
        .where(
            StreamItem.job_id == job_id,
            StreamItem.consumer_id == consumer_id,
            StreamItem.acked_at.is_(None),
            StreamItem.lease_expires >= now,
        )
        .order_by(StreamItem.unit_index)
    ).all()
    unseen = [(int(i), int(d)) for i, d in held if (int(i), int(d)) not in seen][:limit]
    renewed: list[int] = []
    for item_id, delivery in unseen:
        result = session.execute(
            update(StreamItem)
            .where(
                StreamItem.id == item_id,
                StreamItem.consumer_id == consumer_id,
                StreamItem.delivery == delivery,
                StreamItem.acked_at.is_(None),
            )
            .values(lease_expires=now + lease_seconds)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount:  # type: ignore[attr-defined]
            renewed.append(item_id)
    return leased_items(session, renewed)


def leased_items(session: Session, item_ids: list[int]) -> list[LeasedItem]:
    """What a lease answer says of each item, in unit order."""
    if not item_ids:
        return []
    rows = session.execute(
        select(
            StreamItem.id,
            StreamItem.delivery,
            StreamItem.unit_index,
            StreamItem.lease_expires,
            Shard.path,
            Shard.sha256,
            Shard.bytes,
            Shard.samples,
            Shard.tokens,
            Shard.header_sha256,
        )
        .join(Shard, StreamItem.shard_id == Shard.id)
        .where(StreamItem.id.in_(item_ids))
        .order_by(StreamItem.unit_index)
    ).all()
    return [
        LeasedItem(int(i), int(d), int(u), float(expires or 0.0), str(p), str(h), int(b), int(n), int(t), hh)
        for i, d, u, expires, p, h, b, n, t, hh in rows
    ]


def ack_item(session: Session, job_id: str, consumer_id: str, item_id: int, delivery: int, now: float) -> int:
    """Acknowledge one delivery; returns the item's bytes, or -1 when this consumer does not hold that
    delivery (acknowledged already, or leased again to another consumer after its lease ran out)."""
    result = session.execute(
        update(StreamItem)
        .where(
            StreamItem.id == item_id,
            StreamItem.job_id == job_id,
            StreamItem.consumer_id == consumer_id,
            StreamItem.delivery == delivery,
            StreamItem.acked_at.is_(None),
        )
        .values(acked_at=now, acked_by=consumer_id, consumer_id=None, lease_expires=None)
        .execution_options(synchronize_session=False)
    )
    if not result.rowcount:  # type: ignore[attr-defined]
        return -1
    return int(session.scalar(select(StreamItem.bytes).where(StreamItem.id == item_id)) or 0)


def acked_as(session: Session, job_id: str, consumer_id: str, item_id: int, delivery: int) -> bool:
    """This very delivery was acknowledged by this consumer (an acknowledgement repeated by a retry)."""
    return (
        session.scalar(
            select(StreamItem.id).where(
                StreamItem.id == item_id,
                StreamItem.job_id == job_id,
                StreamItem.acked_by == consumer_id,
                StreamItem.delivery == delivery,
                StreamItem.acked_at.is_not(None),
            )
        )
        is not None
    )


def count_acks(session: Session, consumer_id: str, items: int, nbytes: int) -> None:
    session.execute(
        update(StreamConsumer)
        .where(StreamConsumer.id == consumer_id)
        .values(
            items_acked=StreamConsumer.items_acked + items, bytes_acked=StreamConsumer.bytes_acked + nbytes
        )
        .execution_options(synchronize_session=False)
    )


def release_leases_of(session: Session, consumer_id: str) -> int:
    result = session.execute(
        update(StreamItem)
        .where(StreamItem.consumer_id == consumer_id, StreamItem.acked_at.is_(None))
        .values(consumer_id=None, lease_expires=None)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def acked_undeleted(session: Session, job_id: str) -> list[tuple[int, str]]:
    """Acknowledged items whose shard file is not known to be gone: (item id, shard path)."""
    rows = session.execute(
        select(StreamItem.id, Shard.path)
        .join(Shard, StreamItem.shard_id == Shard.id)
        .where(StreamItem.job_id == job_id, StreamItem.acked_at.is_not(None), StreamItem.deleted_at.is_(None))
    ).all()
    return [(int(item_id), str(path)) for item_id, path in rows]


def shard_deleted(session: Session, shard_id: int) -> bool:
    """Whether the shard's item was acknowledged and its copies deleted (consume retention)."""
    return bool(
        session.scalar(
            select(func.count())
            .select_from(StreamItem)
            .where(StreamItem.shard_id == shard_id, StreamItem.deleted_at.is_not(None))
        )
    )


def mark_deleted(session: Session, item_ids: Sequence[int], now: float) -> None:
    if item_ids:
        session.execute(
            update(StreamItem)
            .where(StreamItem.id.in_(list(item_ids)), StreamItem.acked_at.is_not(None))
            .values(deleted_at=now)
            .execution_options(synchronize_session=False)
        )


def item_counts(session: Session, job_id: str, now: float) -> ItemCounts:
    """Items of the job by where they stand; shards committed since the last lease count as ready."""
    live = and_(StreamItem.consumer_id.is_not(None), StreamItem.lease_expires >= now)
    row = session.execute(
        select(
            func.count().filter(StreamItem.acked_at.is_not(None)),
            func.count().filter(live),
            func.coalesce(func.sum(StreamItem.bytes).filter(live), 0),
        ).where(StreamItem.job_id == job_id)
    ).one()
    acked, leased, leased_bytes = int(row[0]), int(row[1]), int(row[2])
    shards, shard_bytes = session.execute(
        select(func.count(), func.coalesce(func.sum(Shard.bytes), 0)).where(Shard.job_id == job_id)
    ).one()
    acked_bytes = acked_bytes_of(session, job_id)
    return ItemCounts(
        ready=int(shards) - acked - leased,
        leased=leased,
        acked=acked,
        ready_bytes=int(shard_bytes) - acked_bytes - leased_bytes,
        leased_bytes=leased_bytes,
    )


def acked_bytes_of(session: Session, job_id: str) -> int:
    return int(
        session.scalar(
            select(func.coalesce(func.sum(StreamItem.bytes), 0)).where(
                StreamItem.job_id == job_id, StreamItem.acked_at.is_not(None)
            )
        )
        or 0
    )


def buffered_bytes(session: Session, job_id: str) -> int:
    """Committed shard bytes not acknowledged yet."""
    committed = session.scalar(select(func.coalesce(func.sum(Shard.bytes), 0)).where(Shard.job_id == job_id))
    return int(committed or 0) - acked_bytes_of(session, job_id)


def largest_shard_bytes(session: Session, job_id: str) -> int:
    return int(session.scalar(select(func.max(Shard.bytes)).where(Shard.job_id == job_id)) or 0)


def live_unit_leases(session: Session, job_id: str, now: float) -> int:
    return int(
        session.scalar(
            select(func.count())
            .select_from(WorkUnit)
            .where(
                WorkUnit.job_id == job_id,
                WorkUnit.state == UnitState.leased.value,
                WorkUnit.lease_expires >= now,
            )
        )
        or 0
    )


def job_options(session: Session, job_id: str) -> dict[str, Any] | None:
    options = session.scalar(select(Job.options).where(Job.id == job_id))
    return None if options is None else dict(options)


def lock_job(session: Session, job_id: str) -> Job | None:
    """The job row, locked for this transaction, so claims of one consume job are decided one at a time
    and two workers cannot both take the last room under the cap. A no-op UPDATE rather than SELECT FOR
    UPDATE: on SQLite it takes the database's write lock (and a fresh snapshot) as well."""
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(updated_at=Job.updated_at)
        .execution_options(synchronize_session=False)
    )
    return session.get(Job, job_id, populate_existing=True)


def consumer_leases(session: Session, job_id: str, now: float) -> dict[str, tuple[int, int]]:
    """Per consumer: live leased items and their bytes."""
    rows = session.execute(
        select(StreamItem.consumer_id, func.count(), func.coalesce(func.sum(StreamItem.bytes), 0))
        .where(
            StreamItem.job_id == job_id,
            StreamItem.consumer_id.is_not(None),
            StreamItem.lease_expires >= now,
        )
        .group_by(StreamItem.consumer_id)
    ).all()
    return {str(c): (int(n), int(b)) for c, n, b in rows}


def unacked_outside_group(session: Session, job_id: str, group_name: str, now: float) -> int:
    """Committed shards neither acknowledged nor under a live lease of a consumer of this group: what a
    consumer of the group may still be handed (now, or once another reader's lease runs out)."""
    group = select(StreamConsumer.id).where(
        StreamConsumer.job_id == job_id, StreamConsumer.group_name == group_name
    )
    held = int(
        session.scalar(
            select(func.count())
            .select_from(StreamItem)
            .where(
                StreamItem.job_id == job_id,
                StreamItem.consumer_id.in_(group),
                StreamItem.lease_expires >= now,
            )
        )
        or 0
    )
    shards = int(session.scalar(select(func.count()).select_from(Shard).where(Shard.job_id == job_id)) or 0)
    acked = int(
        session.scalar(
            select(func.count())
            .select_from(StreamItem)
            .where(StreamItem.job_id == job_id, StreamItem.acked_at.is_not(None))
        )
        or 0
    )
    return shards - acked - held
