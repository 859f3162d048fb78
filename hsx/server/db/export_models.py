"""The exports table: one row per export of a job's output into a trainer's layout, made through the API.

The API writes the row (``queued``) and commits before it enqueues the export's RQ task; a worker (which
sees the output) moves it through ``running`` to ``succeeded`` or ``failed``. The row is the only record
of an export's state: the API never reads the export folder, nor the output it was made from."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, DateTime, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from hsx.server.db.base import Base, utcnow


class Export(Base):
    __tablename__ = "exports"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    format: Mapped[str] = mapped_column(String(32))
    options: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Where the worker writes it (a path on the workers' hosts; it exists only once the export succeeded).
    dest: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default="queued")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # {"error", "detail"} of a failed export; the report (hsx_export.json) of a succeeded one.
    error: Mapped[dict[str, str] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    report: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
