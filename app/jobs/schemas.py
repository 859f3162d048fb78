"""Request and response shapes of the jobs API."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from app.streams.schemas import StreamStatus
from hsx.server.job_options import JobOptions

JobStateName = Literal["queued", "running", "succeeded", "failed", "cancelled"]


def _as_utc(value: datetime) -> datetime:
    # SQLite hands back naive datetimes (stored as UTC), PostgreSQL aware ones in the session's time zone;
    # both are shown the same way, in UTC with its offset.
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


UtcDatetime = Annotated[datetime, AfterValidator(_as_utc)]

# Read by attribute from the library's own rows and types (hsx.server.db.models.Shard, Rejection and
# Truncation, hsx.server.jobs.queries.FailedUnit, hsx.server.jobs.repository.LiveCounts): a field is named
# once, there, and described here.
_FROM_LIBRARY = ConfigDict(from_attributes=True)


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    dataset_uri: str = Field(min_length=1, max_length=4096)
    options: JobOptions = Field(default_factory=lambda: JobOptions())
    idempotency_key: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:\-]+$")


class InFlight(BaseModel):
    """Handled by units still at work: counted in progress, committed (and exact) once the unit commits."""

    model_config = _FROM_LIBRARY

    samples_done: int
    samples_rejected: int
    tokens: int


class Progress(BaseModel):
    samples_total: int
    samples_done: int = Field(description="Committed, plus what units at work have handled so far.")
    samples_rejected: int
    samples_truncated: int = Field(0, description="Kept samples cut to max_length (committed).")
    tokens: int
    tokens_per_second: float | None
    eta_seconds: float | None
    units_total: int
    units_done: int
    fraction: float
    in_flight: InFlight | None = Field(None, description="The part of the counts not committed yet.")


class RegenerateProgress(BaseModel):
    """A regenerate job's generation beside its capture: each with its own tokens and rate."""

    samples_regenerated: int = Field(description="Samples whose regenerated text is kept (durable).")
    samples_failed: int = Field(description="Samples that could not be regenerated (in the rejections).")
    turns_generated: int
    turns_at_length: int = Field(description="Generated turns that stopped on max_new_tokens.")
    generated_tokens: int = Field(description="Tokens the engine generated for the kept samples.")
    generated_tokens_per_second: float | None
    captured_tokens: int = Field(description="Tokens of the samples captured into shards.")
    captured_tokens_per_second: float | None
    href: str = Field(description="The regenerated dataset as JSONL (GET it).")


class ShardOut(BaseModel):
    model_config = _FROM_LIBRARY

    path: str
    sha256: str
    bytes: int
    samples: int
    tokens: int


class ShardsPreview(BaseModel):
    total: int
    items: list[ShardOut] = Field(description="The first shards, in order; the rest are at href.")
    href: str = Field(description="Every shard, paginated: GET this with limit and offset.")


class RejectionOut(BaseModel):
    model_config = _FROM_LIBRARY

    sample_index: int
    record_id: str | None = Field(None, description='The record\'s own "id" or "conversation_id".')
    reason: str
    detail: str


class TruncationOut(BaseModel):
    model_config = _FROM_LIBRARY

    sample_index: int
    record_id: str | None
    tokens: int = Field(description="Tokens before the cut.")
    kept: int


class FailedUnitOut(BaseModel):
    model_config = _FROM_LIBRARY

    unit_index: int
    failures: int
    error: str | None


class OutputOut(BaseModel):
    projected_bytes: int | None = Field(description="What the shards will take, projected at prepare.")
    projection_exact: bool | None = Field(description="False: an estimate from a sample of records.")
    projection_basis: str | None
    free_bytes_at_prepare: int | None
    bytes_written: int = Field(description="Bytes of the shards committed so far.")
    uri: str | None = Field(
        default=None,
        description="Where the output is published (HSX_OUTPUT_URI/<job id>, fixed at submission): unit by "
        "unit as units commit, the manifest last; null when it stays in output_dir only.",
    )


class JobOut(BaseModel):
    id: str
    state: JobStateName
    dataset_uri: str
    options: JobOptions
    progress: Progress
    error: str | None
    output_dir: str
    manifest: str | None
    engine: dict[str, object] | None
    engines: list[dict[str, object]] = Field(
        default_factory=list,
        description="Every engine a worker brought to the job: ok, or why it was unfit or unavailable.",
    )
    output: OutputOut | None = None
    engine_wait: str | None = Field(
        None,
        description="Whether a job is refused at submit for an unfit engine or waits for a fit one, and how "
        "long (HSX_ENGINE_FLEET, HSX_NO_FIT_ENGINE_SECONDS).",
    )
    units_failed: list[FailedUnitOut] = Field(
        default_factory=list, description="Units that failed for good, with their last error."
    )
    shards: ShardsPreview
    rejections: dict[str, int] = Field(description="Rejected samples counted by reason.")
    stream: StreamStatus | None = Field(
        None, description="A consume job, or one with consumers: buffered bytes, the cap, consumers."
    )
    regenerate: RegenerateProgress | None = Field(
        None, description="A regenerate job: generated and captured tokens, each with its rate."
    )
    created_at: UtcDatetime
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None


class JobSummary(BaseModel):
    id: str
    state: JobStateName
    dataset_uri: str
    progress: Progress
    error: str | None
    created_at: UtcDatetime


class JobPage(BaseModel):
    items: list[JobSummary]
    total: int
    limit: int
    offset: int


class ShardPage(BaseModel):
    items: list[ShardOut]
    total: int
    limit: int
    offset: int


class RejectionPage(BaseModel):
    items: list[RejectionOut]
    total: int
    limit: int
    offset: int


class TruncationPage(BaseModel):
    items: list[TruncationOut]
    total: int
    limit: int
    offset: int


class CheckOut(BaseModel):
    """One check of the validator (hsx.engine.validation.Check); a failed dump check names the reason code a
    job would reject the sample with."""

    name: str
    ok: bool
    expected: object
    actual: object
    reason: str | None = None
    detail: str = ""


class VerifyOut(BaseModel):
    ok: bool
    checks: list[CheckOut]


class ErrorOut(BaseModel):
    error: str
    detail: str
