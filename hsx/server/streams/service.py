"""The rules of a job's stream: who may read it, what a lease hands out, what an acknowledgement frees,
and whether a worker may claim another unit of a consume job (the byte cap). The API and the workers both
call here; the queries are in :mod:`hsx.server.streams.repository` and the counts in
:mod:`hsx.server.streams.item_counts`. Nothing here touches the output: the API records acknowledgements,
and the hosts that hold the shards delete them (:mod:`hsx.server.streams.deletion`)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy.orm import Session

from hsx.errors import Conflict, NotFound
from hsx.server.db.models import Job, JobState
from hsx.server.db.stream_models import StreamConsumer
from hsx.server.job_options import JobOptions
from hsx.server.jobs import queries as job_queries
from hsx.server.jobs import repository as jobs_repo
from hsx.server.jobs.publication import destination_of, shard_uri
from hsx.server.jobs.unit_results import CommittedUnit
from hsx.server.settings import Settings
from hsx.server.streams import repository as repo
from hsx.server.streams.budget import Budget
from hsx.server.streams.item_counts import ItemCounts, item_counts, unacked_outside_group
from hsx.server.streams.news import ROOM, announce
from hsx.server.streams.repository import LeasedItem
from hsx.server.streams.views import ConsumerView, consumer_view, consumer_views
from hsx.streams.contract import CONSUME

log = logging.getLogger(__name__)

# A lease that hands nothing out records the consumer's last contact at most this often (idle_seconds in
# the job document is that much behind at worst).
TOUCH_SECONDS = 1.0


def retention_of(stored: Mapping[str, Any] | None) -> str:
    """A job row's retention, read through the one options model (old rows: keep)."""
    return JobOptions.from_stored(stored).retention


def cap_of(job: Job, settings: Settings) -> int:
    """A consume job's byte cap (a job that keeps its output has none: 0; :func:`budget` never asks)."""
    options = JobOptions.from_stored(job.options).with_cap(settings.stream_buffer_cap_bytes)
    return options.buffer_cap_bytes or 0


def unit_bytes(job: Job, counts: ItemCounts) -> int:
    """What one unit's shard is expected to take: the projection's share per unit, or the largest shard
    committed so far when that is more (a projection from a sample of records is an estimate)."""
    projected = (job.projection or {}).get("bytes") or 0
    share = -(-int(projected) // job.units_total) if job.units_total else 0
    return max(share, counts.largest_bytes)


def budget(session: Session, job: Job, settings: Settings, now: float) -> Budget | None:
    """A consume job's bytes as the claim rule counts them; None for a job that keeps its output."""
    if retention_of(job.options) != CONSUME:
        return None
    return budget_of(job, settings, item_counts(session, job.id, now))


def budget_of(job: Job, settings: Settings, counts: ItemCounts) -> Budget:
    return Budget(
        cap_bytes=cap_of(job, settings),
        stored_bytes=counts.stored_bytes,
        acked_stored_bytes=counts.acked_stored_bytes,
        leased_units=counts.live_units,
        unit_bytes=unit_bytes(job, counts),
    )


def record_item(session: Session, committed: CommittedUnit) -> None:
    """A unit-commit hook (:func:`hsx.server.jobs.unit_results.commit_unit`): the committed shard's stream
    item, written in the same transaction, so every committed shard is an item the moment it is visible."""
    if committed.shard_id is not None and committed.shard is not None:
        unit = committed.unit
        repo.add_item(session, unit.job_id, committed.shard_id, unit.unit_index, committed.shard.bytes)


def may_claim(session: Session, job_id: str, settings: Settings, now: float) -> bool:
    """Called in the claim's own transaction: the job row is locked first, so claims of one consume job
    are decided one after another and the cap holds with any number of workers."""
    options = repo.job_options(session, job_id)
    if options is None or retention_of(options) != CONSUME:
        return options is not None  # a keep job's claims take no lock
    job = repo.lock_job(session, job_id)
    if job is None:
        return False
    room = budget(session, job, settings, now)
    if room is None:
        return True
    return room.may_claim()


def waiting_on_consumers(session: Session, job: Job, settings: Settings, now: float) -> bool:
    """Work is left to claim and the cap holds it back until consumers acknowledge (acknowledged shards
    not deleted yet hold nothing back for long: the next worker to claim deletes them first)."""
    return _cap_refuses_work_left(session, job, settings, now, Budget.may_claim_once_deleted)


def cap_holds_back(session: Session, job_id: str, settings: Settings, now: float) -> bool:
    """A worker's wait for room goes on: the job runs, a unit is left to claim, and the cap refuses it,
    counting every shard still stored (the waiting worker deletes acknowledged ones before it asks, so a
    shard it cannot delete keeps it waiting rather than claiming in a loop that the cap refuses)."""
    job = jobs_repo.get_job(session, job_id)
    return job is not None and _cap_refuses_work_left(session, job, settings, now, Budget.may_claim)


def _cap_refuses_work_left(
    session: Session, job: Job, settings: Settings, now: float, allows: Callable[[Budget], bool]
) -> bool:
    """The job runs, a unit is left to claim, and its cap, read by ``allows``, refuses the claim."""
    if job.state != JobState.running.value:
        return False
    room = budget(session, job, settings, now)
    return room is not None and not allows(room) and job_queries.claimable_count(session, job.id, now) > 0


def wakeable_units(session: Session, job_id: str, settings: Settings, now: float) -> int:
    """Claimable units worth waking workers for: none while a consume job's cap holds them back (its
    acknowledgements wake workers then; nothing polls it)."""
    claimable = job_queries.claimable_count(session, job_id, now)
    job = jobs_repo.get_job(session, job_id) if claimable else None
    if job is not None and waiting_on_consumers(session, job, settings, now):
        return 0
    return claimable


@dataclass
class LeaseAnswer:
    job_state: str
    items: list[LeasedItem]
    # The job succeeded and every shard is acknowledged or leased to this consumer's group (which
    # acknowledges it after its optimizer step): nothing more comes. A shard another reader holds keeps the
    # stream open until that reader acknowledges it or its lease runs out and the shard comes here.
    end_of_stream: bool
    error: str | None = None

    def worth_waiting(self) -> bool:
        """Nothing handed out and nothing final said: a lease that may wait looks again on news."""
        ended = self.job_state in (JobState.failed.value, JobState.cancelled.value)
        return not self.items and not self.end_of_stream and not ended


@dataclass
class AckAnswer:
    acked: list[int] = field(default_factory=list)
    # Of ``acked``: deliveries this consumer had acknowledged in an earlier call (a retry whose first answer
    # was lost), accepted and not counted again.
    repeated: list[int] = field(default_factory=list)
    # Deliveries this consumer does not hold (another delivery of the item, or another consumer's): not
    # counted, and the item's fate is the other delivery's.
    refused: list[dict[str, Any]] = field(default_factory=list)


class StreamService:
    def __init__(self, session: Session, settings: Settings) -> None:
        self.session = session
        self.settings = settings

    def _job(self, job_id: str) -> Job:
        job = None if "\x00" in job_id or len(job_id) > 36 else jobs_repo.get_job(self.session, job_id)
        if job is None:
            raise NotFound(f"no job {job_id}", error="job_not_found")
        return job

    def _consumer(self, job_id: str, consumer_id: str) -> StreamConsumer:
        consumer = None if len(consumer_id) > 36 else repo.get_consumer(self.session, job_id, consumer_id)
        if consumer is None:
            raise NotFound(f"no consumer {consumer_id} of job {job_id}", error="consumer_not_found")
        return consumer

    def register(
        self, job_id: str, name: str, lease_seconds: float | None, group: str | None = None
    ) -> StreamConsumer:
        job = self._job(job_id)
        if job.state in (JobState.failed.value, JobState.cancelled.value):
            raise Conflict(f"job is {job.state}: {job.error or ''}".strip(), error="job_not_streamable")
        now = time.time()
        consumer_id = str(uuid.uuid4())
        consumer = StreamConsumer(
            id=consumer_id,
            job_id=job_id,
            name=name,
            group_name=group or consumer_id,
            lease_seconds=lease_seconds or self.settings.stream_lease_seconds,
            last_seen=now,
            items_acked=0,
            bytes_acked=0,
        )
        repo.add_consumer(self.session, consumer)
        self.session.commit()
        return consumer

    def consumers(self, job_id: str) -> list[ConsumerView]:
        self._job(job_id)
        return consumer_views(self.session, job_id, time.time())

    def lease(
        self,
        job_id: str,
        consumer_id: str,
        max_items: int,
        seen: list[tuple[int, int]] | None = None,
    ) -> LeaseAnswer:
        """Up to ``max_items`` items. With ``seen`` (the deliveries the consumer has received and may
        still hold), what it holds but never received comes first: the answer that leased it was lost (a
        restart, a cut connection), and the consumer need not wait for the lease to run out."""
        job = self._job(job_id)
        consumer = self._consumer(job_id, consumer_id)
        now = time.time()
        if job.state in (JobState.failed.value, JobState.cancelled.value):
            # A trainer must never take a failed job for the end of its data: it is told, and given nothing.
            self._seen(consumer, now, wrote=False)
            return LeaseAnswer(job.state, [], False, job.error)
        # A job published to an object store hands out a shard once it is there, and says where.
        destination = destination_of(job, self.settings)
        items = (
            []
            if seen is None
            else repo.held_unseen(
                self.session, job_id, consumer.id, set(seen), max_items, consumer.lease_seconds, now
            )
        )
        if len(items) < max_items:
            items += repo.lease_items(
                self.session,
                job_id,
                consumer.id,
                max_items - len(items),
                consumer.lease_seconds,
                now,
                bool(destination),
            )
        if destination:
            items = [replace(i, uri=shard_uri(destination, job.output_dir, i.path)) for i in items]
        end = (
            not items
            and job.state == JobState.succeeded.value
            and unacked_outside_group(self.session, job_id, consumer.group_name, now) == 0
        )
        self._seen(consumer, now, wrote=bool(items))
        return LeaseAnswer(job.state, items, end, job.error)

    def _seen(self, consumer: StreamConsumer, now: float, wrote: bool) -> None:
        """Record when the consumer was last heard from, and end the transaction. A lease that leased nothing
        writes it at most every ``TOUCH_SECONDS``: waiting leases look at every commit's news, and a write
        each time took SQLite's one write lock (and a row lock on PostgreSQL) from the workers' claims and
        commits just to move a figure the API shows rounded to a tenth of a second."""
        if wrote or now - consumer.last_seen >= TOUCH_SECONDS:
            repo.touch_consumer(self.session, consumer.id, now)
        self.session.commit()

    def ack(self, job_id: str, consumer_id: str, deliveries: list[tuple[int, int]]) -> AckAnswer:
        """Acknowledge deliveries (item id, delivery). Only recorded: in consume mode the workers delete the
        acknowledged shards where they live (this process may see the output read-only, or not at all),
        and wake-ups go out when that deletion would make room under the cap. A delivery this consumer
        acknowledged before is accepted again and counted once: a client retries an acknowledgement whose
        answer it did not get, and must not be told that a committed one failed."""
        job = self._job(job_id)
        consumer = self._consumer(job_id, consumer_id)
        now = time.time()
        answer = AckAnswer()
        nbytes = 0
        for item_id, delivery in deliveries:
            size = repo.ack_item(self.session, job_id, consumer.id, item_id, delivery, now)
            if size >= 0:
                answer.acked.append(item_id)
                nbytes += size
            elif repo.acked_as(self.session, job_id, consumer.id, item_id, delivery):
                # Its first acknowledgement committed and the answer was lost: a retry, counted once.
                answer.acked.append(item_id)
                answer.repeated.append(item_id)
            else:
                answer.refused.append(
                    {"id": item_id, "delivery": delivery, "reason": "not leased to this consumer"}
                )
        fresh = len(answer.acked) - len(answer.repeated)
        repo.count_acks(self.session, consumer.id, fresh, nbytes)
        repo.touch_consumer(self.session, consumer.id, now)
        self.session.commit()
        if fresh and retention_of(job.options) == CONSUME and job.state == JobState.running.value:
            announce(self.settings, job_id, ROOM)  # a worker waiting under the cap looks again
            wake_workers(self.settings, self.session, job_id)
        if fresh and job.state == JobState.succeeded.value:
            announce(self.settings, job_id)  # another group's stream may have ended with these
        return answer

    def close(self, job_id: str, consumer_id: str) -> int:
        """A consumer leaves: what it holds goes back to the others at once. Returns how many items."""
        self._job(job_id)
        consumer = self._consumer(job_id, consumer_id)
        released = repo.release_leases_of(self.session, consumer.id)
        self.session.delete(consumer)
        self.session.commit()
        if released:
            announce(self.settings, job_id)  # what it held goes to a waiting lease now
        return released


def wake_workers(settings: Settings, session: Session, job_id: str) -> None:
    """Acknowledgements made room under the cap once their shards are deleted: wake idle workers for the
    job, which delete them and claim (after the commit; a lost wake-up is repaired by the reconciler, which
    deletes acknowledged shards and wakes a consume job whenever it may claim)."""
    from hsx.server.jobs.queue import wake_idle_workers

    now = time.time()
    try:
        claimable = job_queries.claimable_count(session, job_id, now)
        # Read without the claim's lock (BEGIN IMMEDIATE on SQLite: the whole database's write lock, taken
        # on every acknowledgement from the workers' claims and commits): whether a wake-up is worth sending
        # may be judged on a view a moment old, the claim itself decides under the lock.
        job = jobs_repo.get_job(session, job_id) if claimable else None
        room = None if job is None else budget(session, job, settings, now)
        session.rollback()
        if job is not None and (room is None or worth_waking(room)):
            wake_idle_workers(settings, job_id, claimable)
    except Exception as exc:  # noqa: BLE001 - the reconciler is the safety net for a lost wake-up
        log.warning("could not wake workers for job %s after acknowledgements: %s", job_id, exc)


def worth_waking(room: Budget) -> bool:
    """Whether an acknowledgement should wake idle workers: a unit would fit once the acknowledged shards
    are deleted, and either the cap is what holds the job back now or no worker holds a unit of it. While
    workers hold units and one more fits, they claim it themselves and wake others as they do for a keep
    job; a wake-up sent then only forked a work horse that found the job in hand (one an acknowledgement,
    bench/RESULTS.md)."""
    return room.may_claim_once_deleted() and (not room.may_claim() or room.leased_units == 0)


@dataclass(frozen=True)
class StreamStatus:
    retention: str
    cap_bytes: int | None
    buffered_bytes: int
    stored_bytes: int
    in_flight_bytes: int
    unit_bytes: int
    waiting_on_consumers: bool
    items_ready: int
    items_leased: int
    items_acked: int
    lag_bytes: int
    consumers: list[ConsumerView]


def status(session: Session, job: Job, settings: Settings, now: float) -> StreamStatus | None:
    """A job's stream as ``GET /jobs/{id}`` shows it; None for a keep job nobody reads."""
    consumers = repo.list_consumers(session, job.id)
    consume = retention_of(job.options) == CONSUME
    if not consume and not consumers:
        return None
    counts = item_counts(session, job.id, now)
    room = budget_of(job, settings, counts) if consume else None
    leases = repo.consumer_leases(session, job.id, now)
    waiting = (
        room is not None
        and job.state == JobState.running.value
        and not room.may_claim_once_deleted()
        and job_queries.claimable_count(session, job.id, now) > 0
    )
    return StreamStatus(
        retention=retention_of(job.options),
        cap_bytes=None if room is None else room.cap_bytes,
        buffered_bytes=counts.unacked_bytes,
        stored_bytes=counts.stored_bytes,
        in_flight_bytes=0 if room is None else room.in_flight_bytes,
        unit_bytes=unit_bytes(job, counts),
        waiting_on_consumers=waiting,
        items_ready=counts.ready,
        items_leased=counts.leased,
        items_acked=counts.acked,
        lag_bytes=counts.ready_bytes,
        consumers=[consumer_view(c, leases.get(c.id, (0, 0)), now) for c in consumers],
    )
