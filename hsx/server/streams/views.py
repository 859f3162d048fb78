"""A job's consumers as the API shows them: the row, with what each holds under a live lease now and how long
it has been quiet. One type serves the consumer routes and the job document's stream, whose schemas are read
from it by attribute (app/streams/schemas.py)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from hsx.server.db.stream_models import StreamConsumer
from hsx.server.streams import repository as repo


@dataclass(frozen=True)
class ConsumerView:
    id: str
    job_id: str
    name: str
    group: str
    lease_seconds: float
    leased_items: int
    leased_bytes: int
    items_acked: int
    bytes_acked: int
    idle_seconds: float


def consumer_view(consumer: StreamConsumer, held: tuple[int, int], now: float) -> ConsumerView:
    """``held``: the items and bytes the consumer holds under a live lease
    (:func:`~hsx.server.streams.repository.consumer_leases`)."""
    items, nbytes = held
    return ConsumerView(
        id=consumer.id,
        job_id=consumer.job_id,
        name=consumer.name,
        group=consumer.group_name,
        lease_seconds=consumer.lease_seconds,
        leased_items=items,
        leased_bytes=nbytes,
        items_acked=consumer.items_acked,
        bytes_acked=consumer.bytes_acked,
        idle_seconds=round(max(now - consumer.last_seen, 0.0), 1),
    )


def consumer_views(session: Session, job_id: str, now: float) -> list[ConsumerView]:
    """Every consumer of the job, in the repository's order."""
    leases = repo.consumer_leases(session, job_id, now)
    return [consumer_view(c, leases.get(c.id, (0, 0)), now) for c in repo.list_consumers(session, job_id)]
