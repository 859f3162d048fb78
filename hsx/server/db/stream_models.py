"""The stream tables: who reads a job (consumers) and what each committed shard's delivery stands at
(items). Acknowledgement is final, and the table itself says so: an acknowledged row may hold no lease."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, DateTime, Float, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from hsx.server.db.base import Base, utcnow


class StreamConsumer(Base):
    """A reader of a job's stream: one per trainer rank or DataLoader worker. Consumers of a job share its
    items: each item goes to one of them at a time, so ranks never see the same sample."""

    __tablename__ = "stream_consumers"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    # The reader this consumer is part of (one trainer: all its ranks and DataLoader workers). The stream
    # ends for a consumer once every shard is acknowledged or leased to its group.
    group_name: Mapped[str] = mapped_column(String(200))
    # How long an item leased to this consumer stays its own without an acknowledgement.
    lease_seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Epoch seconds of its last lease or acknowledgement call.
    last_seen: Mapped[float] = mapped_column(Float)
    items_acked: Mapped[int] = mapped_column(Integer, default=0)
    bytes_acked: Mapped[int] = mapped_column(BigInteger, default=0)


class StreamItem(Base):
    """One committed shard as the unit of delivery. ``delivery`` is the fencing token: every lease bumps
    it, and an acknowledgement must name the delivery it answers."""

    __tablename__ = "stream_items"
    __table_args__ = (
        # Acknowledged is final: a row that is acknowledged holds no lease, so no UPDATE can lease it again.
        CheckConstraint(
            "acked_at IS NULL OR (consumer_id IS NULL AND lease_expires IS NULL)",
            name="ck_stream_items_acked_unleased",
        ),
        Index("ix_stream_items_job_acked", "job_id", "acked_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    # One item per shard, whatever raced to create it.
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id", ondelete="CASCADE"), unique=True)
    unit_index: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)
    delivery: Mapped[int] = mapped_column(Integer, default=0)
    consumer_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    lease_expires: Mapped[float | None] = mapped_column(Float, nullable=True)
    acked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    acked_by: Mapped[str | None] = mapped_column(String(36), nullable=True)
    # Set once the shard file of an acknowledged item is gone (consume retention only).
    deleted_at: Mapped[float | None] = mapped_column(Float, nullable=True)
