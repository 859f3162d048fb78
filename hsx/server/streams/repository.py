"""Statements on the stream tables: consumers, items and their leases and acknowledgements, and what the
deletion of acknowledged shards reads and marks. No rules live here, only SQL; the counts are in
:mod:`hsx.server.streams.item_counts`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, exists, func, insert, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from hsx.server.db.models import Job, Shard
from hsx.server.db.stream_models import StreamConsumer, StreamItem
from hsx.streams.contract import CONSUME


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


def add_item(session: Session, job_id: str, shard_id: int, unit_index: int, nbytes: int) -> None:
    """The item of a shard, written in the transaction that commits the shard."""
    session.execute(
        insert(StreamItem).values(
            job_id=job_id, shard_id=shard_id, unit_index=unit_index, bytes=nbytes, delivery=0
        )
    )


def item_lease_live(now: float) -> ColumnElement[bool]:
    """An item held by a consumer under a lease that has not run out: the one SQL statement of item
    liveness (leases, renewals, counts, the end of the stream all read it)."""
    return and_(StreamItem.consumer_id.is_not(None), StreamItem.lease_expires >= now)


def _leasable(now: float) -> ColumnElement[bool]:
    return and_(StreamItem.acked_at.is_(None), ~item_lease_live(now))


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
            item_lease_live(now),
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
        .order_by(StreamItem.unit_index)
    ).all()
    return [(int(item_id), str(path)) for item_id, path in rows]


def consume_jobs_with_acked_undeleted(session: Session) -> list[str]:
    """Consume jobs, in any state, with acknowledged items whose shards are not known to be gone (a keep
    job's acknowledged shards stay)."""
    rows = session.scalars(
        select(StreamItem.job_id)
        .join(Job, Job.id == StreamItem.job_id)
        .where(
            StreamItem.acked_at.is_not(None),
            StreamItem.deleted_at.is_(None),
            Job.options["retention"].as_string() == CONSUME,
        )
        .distinct()
    ).all()
    return [str(job_id) for job_id in rows]


def mark_deleted(session: Session, item_ids: Sequence[int], now: float) -> None:
    if item_ids:
        session.execute(
            update(StreamItem)
            .where(
                StreamItem.id.in_(list(item_ids)),
                StreamItem.acked_at.is_not(None),
                StreamItem.deleted_at.is_(None),
            )
            .values(deleted_at=now)
            .execution_options(synchronize_session=False)
        )


def job_options(session: Session, job_id: str) -> dict[str, Any] | None:
    options = session.scalar(select(Job.options).where(Job.id == job_id))
    return None if options is None else dict(options)


def lock_job(session: Session, job_id: str) -> Job | None:
    """The job row, locked for this transaction, so claims of one consume job are decided one at a time
    and two workers cannot both take the last room under the cap. On SQLite the transaction is opened
    here with BEGIN IMMEDIATE (the database's write lock, and a snapshot taken under it); on PostgreSQL
    the row is locked with SELECT ... FOR UPDATE. Either way what is read after it is current."""
    if session.get_bind().dialect.name == "sqlite":
        begin_immediate(session)
    else:
        session.execute(select(Job.id).where(Job.id == job_id).with_for_update())
    return session.get(Job, job_id, populate_existing=True)


def begin_immediate(session: Session) -> None:
    """Open the session's SQLite transaction with BEGIN IMMEDIATE. It must be the transaction's first
    statement: a transaction that has read or written already cannot take the lock and keep its view."""
    connection = session.connection()
    driver = connection.connection.driver_connection
    if driver is not None and driver.in_transaction:
        raise RuntimeError("BEGIN IMMEDIATE must open the transaction: this session has one already")
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def consumer_leases(session: Session, job_id: str, now: float) -> dict[str, tuple[int, int]]:
    """Per consumer: live leased items and their bytes."""
    rows = session.execute(
        select(StreamItem.consumer_id, func.count(), func.coalesce(func.sum(StreamItem.bytes), 0))
        .where(
            StreamItem.job_id == job_id,
            item_lease_live(now),
        )
        .group_by(StreamItem.consumer_id)
    ).all()
    return {str(c): (int(n), int(b)) for c, n, b in rows}
