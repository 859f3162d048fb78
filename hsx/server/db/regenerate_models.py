"""The table of regenerated conversations: one row per sample of a regenerate job, written under the lease
of the unit that generated it, before that unit's capture starts, and never rewritten. It is what makes the
text exactly-once: a later attempt at the unit (or a retry unit) reads the kept row instead of sampling
again, so the states in the shard are always those of the text recorded here."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, DateTime, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from hsx.server.db.base import Base, utcnow


class RegeneratedSample(Base):
    __tablename__ = "regenerated_samples"
    __table_args__ = (UniqueConstraint("job_id", "sample_index", name="uq_regenerated_samples_job_sample"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    unit_id: Mapped[int] = mapped_column(ForeignKey("work_units.id", ondelete="CASCADE"))
    # The unit's attempt that generated the text (a later attempt reuses it and writes nothing).
    attempt: Mapped[int] = mapped_column(Integer)
    sample_index: Mapped[int] = mapped_column(Integer)
    record_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # None for a kept text; otherwise the per-sample rejection reason (stable across attempts too).
    reason: Mapped[str | None] = mapped_column(String(64), nullable=True)
    detail: Mapped[str] = mapped_column(Text, default="")
    # The conversation as kept (assistant contents replaced by what was generated), and the capture's ids
    # and loss mask, built from the engine's own token ids for every generated span.
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    input_ids: Mapped[list[int] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    loss_mask: Mapped[list[int] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    generated_tokens: Mapped[int] = mapped_column(Integer, default=0)
    turns_generated: Mapped[int] = mapped_column(Integer, default=0)
    # Turns whose generation stopped on max_new_tokens.
    turns_at_length: Mapped[int] = mapped_column(Integer, default=0)
    # The sampling parameters each turn ran with: {"max_new_tokens", "temperature", "top_p", "seeds", ...}.
    generation: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
