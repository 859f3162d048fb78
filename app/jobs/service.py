"""The rules of the jobs API: validate a submission, record it with its work units, wake the workers only
after the transaction has committed, and present a job's progress."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.jobs import admission, schemas
from app.streams.schemas import StreamStatus
from hsx.engine import fitness as engine_fitness
from hsx.engine.client import EngineClient, EngineError, EngineUnfit
from hsx.engine.validation import RETRIABLE_REASONS
from hsx.errors import BadRequest, Conflict, NotFound, Unprocessable
from hsx.server.db.models import Job, JobState, Shard
from hsx.server.ingest import inspect_dataset
from hsx.server.job_options import JobOptions
from hsx.server.jobs import queries, recovery
from hsx.server.jobs import repository as repo
from hsx.server.jobs.finalize import MANIFEST_NAME
from hsx.server.jobs.publication import destination_of, new_destination
from hsx.server.jobs.queue import enqueue_wakeups
from hsx.server.jobs.repository import LiveCounts
from hsx.server.regenerate import repository as regen_repo
from hsx.server.regenerate.export import sample_line
from hsx.server.settings import Settings
from hsx.server.streams import service as stream_service
from hsx.server.streams.news import announce

log = logging.getLogger(__name__)

# GET /jobs/{id} shows this many shards; GET /jobs/{id}/shards pages through all of them.
SHARDS_IN_DOCUMENT = 10
# A submission asks the engine for its context length and layers this long, then leaves it to the workers.
ENGINE_CHECK_SECONDS = 5.0
UNFIT = "engine_unfit"
RETRIABLE_STATES = (JobState.failed.value, JobState.cancelled.value, JobState.succeeded.value)


def request_hash(dataset_uri: str, options: JobOptions) -> str:
    """The request's identity for idempotency, over the options as recorded (the unit size resolved)."""
    canonical = json.dumps({"dataset_uri": dataset_uri, "options": options.stored()}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


class JobService:
    def __init__(self, session: Session, settings: Settings) -> None:
        self.session = session
        self.settings = settings

    def submit(self, body: schemas.JobCreate, header_key: str | None) -> tuple[Job, bool]:
        """Returns the job and whether it was created by this call (False: an idempotent repeat)."""
        if header_key and body.idempotency_key and header_key != body.idempotency_key:
            raise BadRequest(
                "the Idempotency-Key header and body field differ", error="idempotency_key_mismatch"
            )
        key = header_key or body.idempotency_key
        options = body.options.with_unit_size(self.settings.samples_per_shard)
        options = options.with_cap(self.settings.stream_buffer_cap_bytes)
        digest = request_hash(body.dataset_uri, options)
        if key:
            existing = repo.get_job_by_idempotency_key(self.session, key)
            if existing is not None:
                return self._same_request(existing, digest), False
        # Bounded work only: downloading, converting, counting and indexing are the job's first step, done
        # by a worker. A local dataset is vetted and its head read; a remote one is checked without transfer.
        inspection = inspect_dataset(body.dataset_uri, self.settings)
        dataset_path = inspection.dataset_path
        self._check_records(options, inspection.record_kind)
        self._check_engine(options)
        job_id = str(uuid.uuid4())
        job = Job(
            id=job_id,
            state=JobState.queued.value,
            dataset_uri=body.dataset_uri,
            dataset_path=dataset_path,
            options=options.stored(),
            idempotency_key=key,
            request_hash=digest,
            output_dir=str(self.settings.resolved_output_dir / job_id),
            output_uri=new_destination(job_id, self.settings),
            samples_total=0,
            units_total=0,
        )
        try:
            repo.add_job(self.session, job)
            self.session.commit()
        except IntegrityError:
            # Another request with the same key committed first: answer with its job.
            self.session.rollback()
            existing = repo.get_job_by_idempotency_key(self.session, key) if key else None
            if existing is None:
                raise
            return self._same_request(existing, digest), False
        # One wake-up: the worker that prepares the job wakes more as it claims units (workers.unit_loop).
        enqueue_wakeups(self.settings, job.id, 1)
        return job, True

    @staticmethod
    def _check_records(options: JobOptions, record_kind: str) -> None:
        """Refuse a job that could not keep a sample of the records the dataset's head shows: regenerating
        pre-tokenized records (they have no turns to rewrite; every one would be rejected as
        regenerate_needs_messages). A dataset only a worker reads (remote, Parquet, a folder) or one of
        mixed records is left to the per-sample rejections."""
        if options.regenerate is not None and record_kind == "pretokenized":
            raise Unprocessable(
                "regenerate rewrites the assistant turns of conversations, and the dataset's records are "
                "pre-tokenized (input_ids, no messages): send them in messages form, or leave regenerate out",
                error="regenerate_needs_messages",
            )

    def _check_engine(self, options: JobOptions) -> None:
        """Refuse options the engine cannot honour (a max_length past its context, a regenerate job's
        max_new_tokens that leaves no room for a prompt in it, other aux layers), and,
        unless other engines may join (HSX_ENGINE_FLEET), an engine that fails the preflight
        (:mod:`app.jobs.admission`). An engine that does not answer now is no reason to refuse: every worker
        checks its own engine."""
        url = self.settings.engine_url
        fleet = self.settings.engine_fleet
        try:
            with EngineClient(url, timeout=ENGINE_CHECK_SECONDS, retries=0) as client:
                info = client.info()
        except EngineUnfit as exc:
            if fleet:
                return
            raise Unprocessable(
                f"{exc} (HSX_ENGINE_FLEET=true lets other engines serve it)", error=UNFIT
            ) from exc
        except EngineError:
            return
        for problem in engine_fitness.option_checks(info, options, check_cache=False):
            raise Unprocessable(f"{problem.detail} ({url})", error=problem.code)
        if fleet:
            return
        checked = admission.preflight(self.settings, info)
        if checked.refused:
            raise Unprocessable(
                f"the engine at {url} failed the preflight: {checked.detail} (HSX_ENGINE_FLEET=true "
                "queues the job for other engines instead)",
                error=UNFIT,
            )

    @staticmethod
    def _same_request(job: Job, digest: str) -> Job:
        if job.request_hash != digest:
            raise Conflict(
                "this idempotency key was used for a different request", error="idempotency_key_reused"
            )
        return job

    def get(self, job_id: str) -> Job:
        # An id no job can have (PostgreSQL text cannot hold NUL; ids are 36 characters) is not looked up.
        job = None if "\x00" in job_id or len(job_id) > 36 else repo.get_job(self.session, job_id)
        if job is None:
            raise NotFound(f"no job {job_id}", error="job_not_found")
        return job

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if JobState(job.state).is_final:
            raise Conflict(f"job is already {job.state}", error="job_finished")
        cancelled = repo.set_job_state(
            self.session, job_id, JobState.cancelled, repo.ACTIVE_STATES, error="cancelled by request"
        )
        self.session.commit()
        self.session.refresh(job)
        if not cancelled:
            # It finished between the read above and the compare-and-set: say so, never "200, succeeded".
            raise Conflict(f"job is already {job.state}", error="job_finished")
        announce(self.settings, job_id)  # a waiting lease answers "cancelled" now
        return job

    def retry(self, job_id: str) -> Job:
        """Run a finished job again: failed units from where they stopped, retriable rejections (engine-side
        reasons) as retry units of their own, a job that failed before its units existed from the start.
        Published samples are never run again. 409 while it is active or when nothing is left to retry."""
        job = self.get(job_id)
        if job.state not in RETRIABLE_STATES:
            raise Conflict(f"job is {job.state}; only a finished job can be retried", error="job_active")
        prepared = job.units_total > 0
        if not recovery.reopen_job(self.session, job_id, RETRIABLE_STATES, prepared):
            self.session.rollback()
            raise Conflict("the job changed state meanwhile; try again", error="job_active")
        reopened = recovery.reopen_failed_units(self.session, job_id)
        added = recovery.add_retry_units(
            self.session, job_id, recovery.retriable_rejections(self.session, job_id, RETRIABLE_REASONS)
        )
        if prepared and not queries.open_unit_count(self.session, job_id):
            self.session.rollback()
            raise Conflict(
                f"job {job_id} has no failed unit and no retriable rejection "
                f"({', '.join(sorted(RETRIABLE_REASONS))})",
                error="nothing_to_retry",
            )
        job.engines = None  # this run's engines are met afresh
        self.session.commit()
        enqueue_wakeups(self.settings, job_id, 1)  # after the commit, so the woken worker sees the units
        log.info("job %s retried: %d failed unit(s) reopened, %d retry unit(s)", job_id, reopened, added)
        self.session.refresh(job)
        return job

    # --- presentation -----------------------------------------------------------------------------------

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
        page = queries.shard_page(self.session, self.get(job_id).id, limit, offset)
        return schemas.ShardPage(items=_shards_out(page.items), total=page.total, limit=limit, offset=offset)

    def rejections(self, job_id: str, limit: int, offset: int) -> schemas.RejectionPage:
        page = queries.rejection_page(self.session, self.get(job_id).id, limit, offset)
        items = [schemas.RejectionOut.model_validate(r) for r in page.items]
        return schemas.RejectionPage(items=items, total=page.total, limit=limit, offset=offset)

    def truncations(self, job_id: str, limit: int, offset: int) -> schemas.TruncationPage:
        page = queries.truncation_page(self.session, self.get(job_id).id, limit, offset)
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
        job = self.get(job_id)
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
        service = JobService(session, settings)
        return service.document(service.get(job_id)).model_dump_json().encode()
