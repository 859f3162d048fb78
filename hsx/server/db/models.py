"""The job table: the source of truth for every job, work unit, shard and rejected sample."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from hsx.server.db.base import Base as Base
from hsx.server.db.base import utcnow as utcnow

# The stream, regeneration and export tables: imported here so that Base.metadata holds the whole schema
# wherever the models are imported (migrations, the schema comparison).
from hsx.server.db.export_models import Export as Export
from hsx.server.db.regenerate_models import RegeneratedSample as RegeneratedSample
from hsx.server.db.stream_models import StreamConsumer as StreamConsumer
from hsx.server.db.stream_models import StreamItem as StreamItem


class JobState(str, enum.Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (JobState.succeeded, JobState.failed, JobState.cancelled)


class UnitState(str, enum.Enum):
    pending = "pending"
    leased = "leased"
    done = "done"
    # Failed for good (HSX_UNIT_MAX_FAILURES attempts, or a cause no retry heals); its job failed with it.
    # POST /jobs/{id}/retry makes it pending again.
    failed = "failed"


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default=JobState.queued.value, index=True)
    dataset_uri: Mapped[str] = mapped_column(Text)
    dataset_path: Mapped[str] = mapped_column(Text)
    dataset_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # Set once by the worker that prepared the job: the local JSONL every unit reads its byte range of,
    # and its size then (a file that changed since is refused, not read at shifted offsets).
    records_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    records_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # The lease on preparing a queued job (indexing its dataset, creating its units): one worker does it.
    prepare_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    prepare_expires: Mapped[float | None] = mapped_column(Float, nullable=True)
    options: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), unique=True, nullable=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    output_dir: Mapped[str] = mapped_column(Text)
    # Where the output is published in the object store, s3://bucket/prefix/<job id>, fixed at submission
    # from HSX_OUTPUT_URI: "" for none; NULL for a job submitted before this was recorded (the setting
    # then decides at finalize, as it did).
    output_uri: Mapped[str | None] = mapped_column(Text, nullable=True)
    # What the engine reported when the job started; later workers must match it.
    engine: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    samples_total: Mapped[int] = mapped_column(Integer, default=0)
    samples_done: Mapped[int] = mapped_column(Integer, default=0)
    samples_rejected: Mapped[int] = mapped_column(Integer, default=0)
    # Samples kept but cut to max_length (options.truncation == "truncate"); each is in `truncations`.
    samples_truncated: Mapped[int] = mapped_column(Integer, default=0)
    tokens_done: Mapped[int] = mapped_column(BigInteger, default=0)
    units_total: Mapped[int] = mapped_column(Integer, default=0)
    units_done: Mapped[int] = mapped_column(Integer, default=0)
    # Bytes of the committed shards, and what the whole output is projected to take (set at prepare:
    # {"bytes", "tokens", "exact", "basis", "free_bytes"}).
    bytes_written: Mapped[int] = mapped_column(BigInteger, default=0)
    projection: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # Every engine a worker brought to this job, fit or not: [{"worker", "url", "state", "reason", ...}]
    # (hsx.server.jobs.engines_met). `engine` above is the one the job started with, which the others must
    # match.
    engines: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)


class WorkUnit(Base):
    __tablename__ = "work_units"
    __table_args__ = (
        UniqueConstraint("job_id", "unit_index", name="uq_work_units_job_index"),
        Index("ix_work_units_job_state", "job_id", "state"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    unit_index: Mapped[int] = mapped_column(Integer)
    sample_start: Mapped[int] = mapped_column(Integer)
    sample_end: Mapped[int] = mapped_column(Integer)
    # Where the unit's records lie in the job's records file: a unit reads its own bytes, nothing else.
    byte_start: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    byte_end: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    state: Mapped[str] = mapped_column(String(16), default=UnitState.pending.value)
    # Fencing token: every claim bumps it, and every write of results names the attempt it belongs to.
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # Epoch seconds; all workers compare against their own clock, so hosts must keep NTP time.
    lease_expires: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples_done: Mapped[int] = mapped_column(Integer, default=0)
    samples_rejected: Mapped[int] = mapped_column(Integer, default=0)
    samples_truncated: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Attempts that ended in an error (not a lost lease): at HSX_UNIT_MAX_FAILURES the unit fails.
    failures: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # What the attempt holding the lease has handled so far, written by its heartbeat: progress shows
    # before the unit commits. Only the committed counters above are exact.
    live_samples_done: Mapped[int] = mapped_column(Integer, default=0)
    live_samples_rejected: Mapped[int] = mapped_column(Integer, default=0)
    live_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # A retry unit (POST /jobs/{id}/retry) re-runs these samples of its parent unit's byte range; None for
    # a unit that runs every sample of its range.
    sample_indices: Mapped[list[int] | None] = mapped_column(JSON, nullable=True)
    parent_unit_id: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Shard(Base):
    __tablename__ = "shards"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    unit_id: Mapped[int] = mapped_column(ForeignKey("work_units.id", ondelete="CASCADE"), unique=True)
    # "<job_id>/<unit_index>": a unit's results are recorded once, whatever retried it.
    key: Mapped[str] = mapped_column(String(100), unique=True)
    path: Mapped[str] = mapped_column(Text)
    # Schema 2 shards: sha256 of the data section (written as a stream) and of the header, apart.
    sha256: Mapped[str] = mapped_column(String(64))
    header_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    samples: Mapped[int] = mapped_column(Integer)
    tokens: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Epoch seconds at which the shard was confirmed in the job's object store (its output_uri); a consumer
    # is handed a shard of such a job only from then on.
    published_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Rejection(Base):
    __tablename__ = "rejections"
    __table_args__ = (UniqueConstraint("job_id", "sample_index", name="uq_rejections_job_sample"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    unit_id: Mapped[int] = mapped_column(ForeignKey("work_units.id", ondelete="CASCADE"))
    sample_index: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text, default="")
    # The record's own "id" (or "conversation_id") when it has one.
    record_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # Set when a retry unit takes this sample; the row is replaced when that unit commits.
    retry_unit_id: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Truncation(Base):
    """A sample that was kept but cut to the job's max_length."""

    __tablename__ = "truncations"
    __table_args__ = (UniqueConstraint("job_id", "sample_index", name="uq_truncations_job_sample"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    unit_id: Mapped[int] = mapped_column(ForeignKey("work_units.id", ondelete="CASCADE"))
    sample_index: Mapped[int] = mapped_column(Integer)
    record_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    tokens: Mapped[int] = mapped_column(Integer)  # before the cut
    kept: Mapped[int] = mapped_column(Integer)
