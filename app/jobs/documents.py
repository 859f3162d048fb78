"""What the jobs API answers about a job: its document (progress, output, shards, rejections, stream,
regeneration), the pages of its shards, rejections and truncations, the job list, and the regenerated
dataset. Read-only: the rules that change a job are in :mod:`app.jobs.service`."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy.orm import Session

from app.jobs import admission, schemas
from app.jobs.service import JobService
from app.streams.schemas import StreamStatus
from hsx.errors import Conflict
from hsx.server.db.models import Job, JobState, Shard
from hsx.server.job_options import JobOptions
from hsx.server.jobs import queries
from hsx.server.jobs.finalize import MANIFEST_NAME
from hsx.server.jobs.publication import destination_of
from hsx.server.jobs.repository import LiveCounts
from hsx.server.regenerate import repository as regen_repo
from hsx.server.regenerate.export import sample_line
from hsx.server.settings import Settings
from hsx.server.streams import service as stream_service

# GET /jobs/{id} shows this many shards; GET /jobs/{id}/shards pages through all of them.
SHARDS_IN_DOCUMENT = 10


class JobDocuments:
    """A job as the API shows it. Jobs are found by the service's one look-up, which refuses ids no job can
    have."""

    def __init__(self, session: Session, settings: Settings) -> None:
        self.session = session
        self.settings = settings
        self.service = JobService(session, settings)

    def progress(self, job: Job) -> schemas.Progress:
        live = (
            queries.live_counts(self.session, job.id, time.time())
            if job.state == JobState.running.value
            else LiveCounts(0, 0, 0)
        )
        done = job.samples_done + live.samples_done
        rejected = job.samples_rejected + live.samples_rejected
        tokens = job.tokens_done + live.tokens
        handled = done + rejected
        rate = eta = None
        elapsed = _elapsed_seconds(job)
        if elapsed is not None:
            rate = tokens / elapsed
            if job.state == JobState.running.value and handled:
                eta = max(job.samples_total - handled, 0) * elapsed / handled
        in_flight = live.samples_done + live.samples_rejected + live.tokens
        return schemas.Progress(
            samples_total=job.samples_total,
            samples_done=done,
            samples_rejected=rejected,
            samples_truncated=job.samples_truncated,
            tokens=tokens,
            tokens_per_second=None if rate is None else round(rate, 1),
            eta_seconds=None if eta is None or math.isnan(eta) else round(eta, 1),
            units_total=job.units_total,
            units_done=job.units_done,
            fraction=round(min(handled / job.samples_total, 1.0), 4) if job.samples_total else 0.0,
            in_flight=schemas.InFlight.model_validate(live) if in_flight else None,
        )

    def output(self, job: Job) -> schemas.OutputOut:
        projection = job.projection or {}
        return schemas.OutputOut(
            projected_bytes=projection.get("bytes"),
            projection_exact=projection.get("exact"),
            projection_basis=projection.get("basis"),
            free_bytes_at_prepare=projection.get("free_bytes"),
            bytes_written=job.bytes_written,
            uri=destination_of(job, self.settings) or None,
        )

    def jobs(self, state: str | None, limit: int, offset: int) -> schemas.JobPage:
        page = queries.job_page(self.session, state, limit, offset)
        items = [self.summary(j) for j in page.items]
        return schemas.JobPage(items=items, total=page.total, limit=limit, offset=offset)

    def shards(self, job_id: str, limit: int, offset: int) -> schemas.ShardPage:
        """One page of the job's shards in unit order, and how many there are."""
        page = queries.shard_page(self.session, self.service.get(job_id).id, limit, offset)
        return schemas.ShardPage(items=_shards_out(page.items), total=page.total, limit=limit, offset=offset)

    def rejections(self, job_id: str, limit: int, offset: int) -> schemas.RejectionPage:
        page = queries.rejection_page(self.session, self.service.get(job_id).id, limit, offset)
        items = [schemas.RejectionOut.model_validate(r) for r in page.items]
        return schemas.RejectionPage(items=items, total=page.total, limit=limit, offset=offset)

    def truncations(self, job_id: str, limit: int, offset: int) -> schemas.TruncationPage:
        page = queries.truncation_page(self.session, self.service.get(job_id).id, limit, offset)
        items = [schemas.TruncationOut.model_validate(t) for t in page.items]
        return schemas.TruncationPage(items=items, total=page.total, limit=limit, offset=offset)

    def document(self, job: Job) -> schemas.JobOut:
        manifest = Path(job.output_dir) / MANIFEST_NAME
        first = queries.shard_page(self.session, job.id, SHARDS_IN_DOCUMENT, 0)
        options = JobOptions.from_stored(job.options, self.settings.samples_per_shard)
        progress = self.progress(job)
        return schemas.JobOut(
            id=job.id,
            state=job.state,
            dataset_uri=job.dataset_uri,
            options=options,
            progress=progress,
            error=job.error,
            output_dir=job.output_dir,
            manifest=str(manifest) if job.state == JobState.succeeded.value else None,
            engine=job.engine,
            engines=list(job.engines or []),
            output=self.output(job),
            engine_wait=admission.wait_statement(self.settings),
            units_failed=[
                schemas.FailedUnitOut.model_validate(u) for u in queries.failed_units(self.session, job.id)
            ],
            shards=schemas.ShardsPreview(
                total=first.total, items=_shards_out(first.items), href=f"/jobs/{job.id}/shards"
            ),
            rejections=queries.rejection_counts(self.session, job.id),
            stream=self.stream(job),
            regenerate=self.regeneration(job, progress.tokens) if options.regenerate is not None else None,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
        )

    def regeneration(self, job: Job, captured_tokens: int) -> schemas.RegenerateProgress:
        """Generation and capture side by side: the generated tokens are those of the kept (durable) texts,
        committed or not; the captured ones are the progress's tokens."""
        totals = regen_repo.totals(self.session, job.id)
        elapsed = _elapsed_seconds(job)

        def rate(tokens: int) -> float | None:
            return None if elapsed is None else round(tokens / elapsed, 1)

        return schemas.RegenerateProgress(
            samples_regenerated=totals.samples_kept,
            samples_failed=totals.samples_failed,
            turns_generated=totals.turns_generated,
            turns_at_length=totals.turns_at_length,
            generated_tokens=totals.generated_tokens,
            generated_tokens_per_second=rate(totals.generated_tokens),
            captured_tokens=captured_tokens,
            captured_tokens_per_second=rate(captured_tokens),
            href=f"/jobs/{job.id}/regenerated",
        )

    def regenerated_lines(self, job_id: str) -> Iterator[bytes]:
        """The job's regenerated dataset as JSONL lines, in sample order (kept texts only)."""
        job = self.service.get(job_id)
        if JobOptions.from_stored(job.options).regenerate is None:
            raise Conflict(f"job {job_id} does not regenerate its responses", error="not_regenerated")
        return (sample_line(sample) for sample in regen_repo.kept_in_order(self.session, job.id))

    def stream(self, job: Job) -> StreamStatus | None:
        found = stream_service.status(self.session, job, self.settings, time.time())
        return None if found is None else StreamStatus.model_validate(found, from_attributes=True)

    def summary(self, job: Job) -> schemas.JobSummary:
        return schemas.JobSummary(
            id=job.id,
            state=job.state,
            dataset_uri=job.dataset_uri,
            progress=self.progress(job),
            error=job.error,
            created_at=job.created_at,
        )


def _shards_out(rows: list[Shard]) -> list[schemas.ShardOut]:
    return [schemas.ShardOut.model_validate(s) for s in rows]


def _elapsed_seconds(job: Job) -> float | None:
    """Seconds the job has run (to its end, once finished); None before it started."""
    if job.started_at is None:
        return None
    end = job.finished_at or datetime.now(timezone.utc)
    started = job.started_at if job.started_at.tzinfo else job.started_at.replace(tzinfo=timezone.utc)
    end = end if end.tzinfo else end.replace(tzinfo=timezone.utc)
    return max((end - started).total_seconds(), 1e-6)


def render_document(settings: Settings, job_id: str) -> bytes:
    """``GET /jobs/{id}``'s JSON, in a session of its own (the endpoint renders off the event loop)."""
    from hsx.server.db.session import session_factory

    with session_factory(settings.resolved_database_url)() as session:
        documents = JobDocuments(session, settings)
        return documents.document(documents.service.get(job_id)).model_dump_json().encode()
