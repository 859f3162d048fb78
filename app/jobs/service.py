"""The rules of the jobs API: validate a submission, record it, wake the workers only after the transaction
has committed; find, cancel and retry a job. What the API shows of a job is in :mod:`app.jobs.documents`."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.jobs import admission, schemas
from hsx.engine import fitness as engine_fitness
from hsx.engine.client import EngineClient, EngineError, EngineUnfit
from hsx.engine.validation import RETRIABLE_REASONS
from hsx.errors import BadRequest, Conflict, NotFound, Unprocessable
from hsx.server.db.models import Job, JobState
from hsx.server.ingest import inspect_dataset
from hsx.server.job_options import JobOptions
from hsx.server.jobs import queries, recovery
from hsx.server.jobs import repository as repo
from hsx.server.jobs.publication import new_destination
from hsx.server.jobs.queue import enqueue_wakeups
from hsx.server.settings import Settings
from hsx.server.streams.news import announce

log = logging.getLogger(__name__)

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
