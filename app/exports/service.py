"""The rules of the exports API: only a succeeded job's output is exported, an export that cannot be made
is refused before anything is queued, and the same request while an export is under way (or done) gets
that export back. State lives in a status file per export (hsx.export.status), not in the database."""

from __future__ import annotations

import logging
from pathlib import Path

from rq.exceptions import NoSuchJobError
from rq.job import Job as RqJob
from sqlalchemy.orm import Session

from app.exports import schemas
from app.jobs.service import JobService
from hsx.db.models import JobState
from hsx.errors import BadRequest, Conflict, NotFound, ServiceUnavailable
from hsx.export.common import ExportOptions, options_dict, refusal
from hsx.export.status import (
    ExportStatus,
    export_dest,
    list_statuses,
    new_export_id,
    read_status,
    write_status,
)
from hsx.jobs.queue import EXPORT_TASK, queue_for
from hsx.manifest import Manifest, ManifestError
from hsx.redis_clients import redis_connection
from hsx.settings import Settings

log = logging.getLogger(__name__)
_DEAD_RQ_STATES = {"failed", "stopped", "canceled"}


class ExportService:
    def __init__(self, session: Session, settings: Settings) -> None:
        self.session = session
        self.settings = settings

    def create(self, job_id: str, body: schemas.ExportCreate) -> tuple[ExportStatus, bool]:
        """Returns the export and whether this call created it (False: the same export, already there)."""
        job = JobService(self.session, self.settings).get(job_id)
        if job.state != JobState.succeeded.value:
            raise Conflict(
                f"job is {job.state}; only a succeeded job can be exported", error="job_not_succeeded"
            )
        try:
            manifest = Manifest.load(Path(job.output_dir))
        except ManifestError as exc:
            raise Conflict(f"the job's output cannot be read: {exc}", error="job_output_unreadable") from exc
        options = ExportOptions(
            draft_vocab_size=body.draft_vocab_size,
            target_vocab_size=body.target_vocab_size,
            vocab_max_length=body.vocab_max_length,
            group_size=body.group_size,
        )
        why = refusal(manifest, body.format, options)
        if why:
            raise BadRequest(why, error="export_not_possible")
        wanted = options_dict(options)
        for existing in list_statuses(self.settings, job_id):
            if existing.format == body.format and existing.options == wanted and existing.state != "failed":
                self._requeue_if_lost(existing)
                return existing, False
        export_id = new_export_id()
        status = ExportStatus(
            id=export_id,
            job_id=job_id,
            format=body.format,
            options=wanted,
            source=str(job.output_dir),
            dest=str(export_dest(self.settings, job_id, export_id)),
        )
        write_status(self.settings, status)
        self._enqueue(status)
        return status, True

    def get(self, job_id: str, export_id: str) -> ExportStatus:
        JobService(self.session, self.settings).get(job_id)
        status = read_status(self.settings, job_id, export_id)
        if status is None:
            raise NotFound(f"no export {export_id} of job {job_id}", error="export_not_found")
        return status

    def list(self, job_id: str) -> list[ExportStatus]:
        JobService(self.session, self.settings).get(job_id)
        return list_statuses(self.settings, job_id)

    def _enqueue(self, status: ExportStatus) -> None:
        try:
            queue_for(self.settings).enqueue(
                EXPORT_TASK,
                status.job_id,
                status.id,
                job_id=status.rq_job_id,
                job_timeout=-1,
                result_ttl=86400,
                failure_ttl=7 * 86400,
            )
        except Exception as exc:  # noqa: BLE001 - any Redis failure: say so, and leave no queued ghost
            status.state = "failed"
            status.error = {"error": "queue_unavailable", "detail": f"could not queue the export: {exc}"}
            write_status(self.settings, status)
            raise ServiceUnavailable(
                "the queue is unavailable; try again", error="queue_unavailable"
            ) from exc

    def _requeue_if_lost(self, status: ExportStatus) -> None:
        """An export recorded as under way whose RQ job is gone (Redis lost it) or dead is queued again."""
        if status.state not in ("queued", "running"):
            return
        try:
            rq_state = RqJob.fetch(status.rq_job_id, connection=redis_connection(self.settings)).get_status()
        except NoSuchJobError:
            rq_state = None
        except Exception as exc:  # noqa: BLE001 - cannot tell: leave it, the caller sees its state
            log.warning("could not look up export %s in the queue: %s", status.id, exc)
            return
        if rq_state is None or str(getattr(rq_state, "value", rq_state)) in _DEAD_RQ_STATES:
            log.warning("export %s was %s with no live queue job; queueing it again", status.id, status.state)
            status.state = "queued"
            write_status(self.settings, status)
            self._enqueue(status)


def document(status: ExportStatus) -> schemas.ExportOut:
    return schemas.ExportOut(
        id=status.id,
        job_id=status.job_id,
        format=status.format,
        state=status.state,
        options=status.options,
        dest=status.dest,
        created_at=status.created_at,
        updated_at=status.updated_at,
        attempts=status.attempts,
        error=schemas.ExportError(**status.error) if status.error else None,
        report=status.report,
    )
