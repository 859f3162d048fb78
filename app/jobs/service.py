"""The rules of the jobs API: validate a submission, record it with its work units, wake the workers only
after the transaction has committed, and present a job's progress."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.jobs import schemas
from hsx import engine_fitness
from hsx.db.models import Job, JobState
from hsx.engine_client import EngineClient, EngineError
from hsx.errors import BadRequest, Conflict, NotFound, Unprocessable
from hsx.ingest import inspect_dataset
from hsx.jobs import document_queries, recovery
from hsx.jobs import repository as repo
from hsx.jobs.finalize import MANIFEST_NAME
from hsx.jobs.queue import enqueue_wakeups
from hsx.jobs.repository import LiveCounts
from hsx.settings import Settings
from hsx.validation import RETRIABLE_REASONS

log = logging.getLogger(__name__)

# GET /jobs/{id} shows this many shards; GET /jobs/{id}/shards pages through all of them.
SHARDS_IN_DOCUMENT = 10
# A submission asks the engine for its context length and layers this long, then leaves it to the workers.
ENGINE_CHECK_SECONDS = 5.0
RETRIABLE_STATES = (JobState.failed.value, JobState.cancelled.value, JobState.succeeded.value)


def request_hash(body: schemas.JobCreate) -> str:
    canonical = json.dumps(
        {"dataset_uri": body.dataset_uri, "options": body.options.model_dump(mode="json")}, sort_keys=True
    )
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
        digest = request_hash(body)
        if key:
            existing = repo.get_job_by_idempotency_key(self.session, key)
            if existing is not None:
                return self._same_request(existing, digest), False
        # Bounded work only: downloading, converting, counting and indexing are the job's first step, done
        # by a worker. A local dataset is vetted and its head read; a remote one is checked without transfer.
        dataset_path = inspect_dataset(body.dataset_uri, self.settings).dataset_path
        self._check_engine(body.options)
        job_id = str(uuid.uuid4())
        job = Job(
            id=job_id,
            state=JobState.queued.value,
            dataset_uri=body.dataset_uri,
            dataset_path=dataset_path,
            options=body.options.model_dump(mode="json"),
            idempotency_key=key,
            request_hash=digest,
            output_dir=str(self.settings.resolved_output_dir / job_id),
            samples_total=0,
            units_total=0,
        )
        try:
            repo.add_job(self.session, job, [])
            self.session.commit()
        except IntegrityError:
            # Another request with the same key committed first: answer with its job.
            self.session.rollback()
            existing = repo.get_job_by_idempotency_key(self.session, key) if key else None
            if existing is None:
                raise
            return self._same_request(existing, digest), False
        # One wake-up: the worker that prepares the job wakes more as it claims units (workers.job_runner).
        enqueue_wakeups(self.settings, job.id, 1)
        return job, True

    def _check_engine(self, options: schemas.JobOptions) -> None:
        """Refuse options the engine cannot honour (a max_length past its context, other aux layers). An
        engine that does not answer now is no reason to refuse: every worker checks its own engine."""
        try:
            with EngineClient(self.settings.engine_url, timeout=ENGINE_CHECK_SECONDS, retries=0) as client:
                info = client.info()
        except EngineError:
            return
        problems = engine_fitness.option_problems(info, options.model_dump(mode="json"), check_cache=False)
        for problem in problems:
            code = "max_length_exceeds_context" if problem.startswith("max_length") else "aux_layers_mismatch"
            raise Unprocessable(f"{problem} ({self.settings.engine_url})", error=code)

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
        if prepared and not recovery.open_unit_count(self.session, job_id):
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
            document_queries.live_counts(self.session, job.id, time.time())
            if job.state == JobState.running.value
            else LiveCounts(0, 0, 0)
        )
        done = job.samples_done + live.samples_done
        rejected = job.samples_rejected + live.samples_rejected
        tokens = job.tokens_done + live.tokens
        handled = done + rejected
        rate = eta = None
        if job.started_at is not None:
            end = job.finished_at or datetime.now(timezone.utc)
            started = job.started_at if job.started_at.tzinfo else job.started_at.replace(tzinfo=timezone.utc)
            end = end if end.tzinfo else end.replace(tzinfo=timezone.utc)
            elapsed = max((end - started).total_seconds(), 1e-6)
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
            in_flight=schemas.InFlight(
                samples_done=live.samples_done, samples_rejected=live.samples_rejected, tokens=live.tokens
            )
            if in_flight
            else None,
        )

    def output(self, job: Job) -> schemas.OutputOut:
        projection = job.projection or {}
        return schemas.OutputOut(
            projected_bytes=projection.get("bytes"),
            projection_exact=projection.get("exact"),
            projection_basis=projection.get("basis"),
            free_bytes_at_prepare=projection.get("free_bytes"),
            bytes_written=job.bytes_written,
        )

    def shards(self, job: Job, limit: int, offset: int) -> tuple[list[schemas.ShardOut], int]:
        """One page of the job's shards in order, and how many there are."""
        rows = repo.list_shards(self.session, job.id, limit, offset)
        page = [
            schemas.ShardOut(path=s.path, sha256=s.sha256, bytes=s.bytes, samples=s.samples, tokens=s.tokens)
            for s in rows
        ]
        return page, repo.shard_count(self.session, job.id)

    def document(self, job: Job) -> schemas.JobOut:
        manifest = Path(job.output_dir) / MANIFEST_NAME
        first, total = self.shards(job, SHARDS_IN_DOCUMENT, 0)
        return schemas.JobOut(
            id=job.id,
            state=job.state,
            dataset_uri=job.dataset_uri,
            options=schemas.JobOptions.model_validate(job.options),
            progress=self.progress(job),
            error=job.error,
            output_dir=job.output_dir,
            manifest=str(manifest) if job.state == JobState.succeeded.value else None,
            engine=job.engine,
            engines=list(job.engines or []),
            output=self.output(job),
            units_failed=[
                schemas.FailedUnitOut(unit_index=u.unit_index, failures=u.failures, error=u.error)
                for u in recovery.failed_units(self.session, job.id)
            ],
            shards=schemas.ShardsPreview(total=total, items=first, href=f"/jobs/{job.id}/shards"),
            rejections=repo.rejection_counts(self.session, job.id),
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
        )

    def summary(self, job: Job) -> schemas.JobSummary:
        return schemas.JobSummary(
            id=job.id,
            state=job.state,
            dataset_uri=job.dataset_uri,
            progress=self.progress(job),
            error=job.error,
            created_at=job.created_at,
        )


def render_document(settings: Settings, job_id: str) -> bytes:
    """``GET /jobs/{id}``'s JSON, in a session of its own (the endpoint renders off the event loop)."""
    from hsx.db.session import session_factory

    with session_factory(settings.resolved_database_url)() as session:
        service = JobService(session, settings)
        return service.document(service.get(job_id)).model_dump_json().encode()
