"""Shapes of the fleet views: a job's units, the busy workers, the engines fed."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict


class UnitOut(BaseModel):
    """A unit as hsx.server.jobs.queries.UnitRow has it (validated from that row; its lease owner and expiry
    are shown as the worker, engine and seconds left below)."""

    # Read from the row by attribute: a field is named once, in the library's row, and shown here.
    model_config = ConfigDict(from_attributes=True)

    unit_index: int
    state: str
    attempt: int
    sample_start: int
    sample_end: int
    samples_done: int
    samples_rejected: int
    tokens: int
    worker: str | None
    engine: str | None
    lease_seconds_left: float | None
    finished_at: datetime | None


class UnitPage(BaseModel):
    items: list[UnitOut]
    total: int
    leased: int
    workers_busy: int


class WorkerOut(BaseModel):
    worker: str
    engine: str
    leases: int
    units: list[str]


class EngineOut(BaseModel):
    url: str
    configured: bool
    healthy: bool | None
    info: dict[str, object] | None
    live_leases: int
    units_done_last_hour: int
