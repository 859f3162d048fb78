"""The rules of the exports API: only a succeeded job's output is exported, an export that cannot be made
is refused before anything is queued, and the same request while an export is under way (or done) gets
that export back.

The API never opens the output (it may have no view of the workers' disks): whether an export can be made
is judged on the job's manifest rendered from its rows, the export's state is a row of the job table, and
a worker, which reads the output, makes it and records how it went. The row is committed before the RQ
task is enqueued, so the worker always finds it."""

from __future__ import annotations

import logging

from rq.exceptions import NoSuchJobError
from rq.job import Job as RqJob
from sqlalchemy.orm import Session

from app.exports import schemas
from app.jobs.service import JobService
from hsx.errors import BadRequest, Conflict, NotFound, ServiceUnavailable
from hsx.integrations.exports import ExportOptions, options_dict, refusal
from hsx.manifest import ManifestError
from hsx.server.db.export_models import Export
from hsx.server.db.models import JobState
from hsx.server.export_status import export_dest, is_export_id, new_export_id, rq_job_id
from hsx.server.jobs import exports, queries
from hsx.server.jobs.manifests import manifest_of
from hsx.server.jobs.queue import EXPORT_TASK, queue_for
from hsx.server.redis_clients import redis_connection
from hsx.server.settings import Settings

log = logging.getLogger(__name__)
_DEAD_RQ_STATES = {"failed", "stopped", "canceled"}


class ExportService:
    def __init__(self, session: Session, settings: Settings) -> None:
        self.session = session
        self.settings = settings

    def create(self, job_id: str, body: schemas.ExportCreate) -> tuple[Export, bool]:
        """Returns the export and whether this call created it (False: the same export, already there)."""
        job = JobService(self.session, self.settings).get(job_id)
        if job.state != JobState.succeeded.value:
            raise Conflict(
                f"job is {job.state}; only a succeeded job can be exported", error="job_not_succeeded"
            )
        try:
            manifest = manifest_of(job, queries.list_shards(self.session, job_id), on_disk=False)
        except ManifestError as exc:
            raise Conflict(
                f"the job's output cannot be described: {exc}", error="job_output_unreadable"
            ) from exc
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
        existing = exports.same_export(self.session, job_id, body.format, wanted)
        if existing is not None:
            self._requeue_if_lost(existing)
            return existing, False
        export_id = new_export_id()
        dest = str(export_dest(self.settings, job_id, export_id))  # a path on the workers' hosts, not opened
        row = exports.add(self.session, export_id, job_id, body.format, wanted, dest)
        self.session.commit()
        self._enqueue(row)
        return row, True

    def get(self, job_id: str, export_id: str) -> Export:
        JobService(self.session, self.settings).get(job_id)
        row = exports.get(self.session, job_id, export_id) if is_export_id(export_id) else None
        if row is None:
            raise NotFound(f"no export {export_id} of job {job_id}", error="export_not_found")
        return row

    def list(self, job_id: str) -> list[Export]:
        JobService(self.session, self.settings).get(job_id)
        return exports.of_job(self.session, job_id)

    def _enqueue(self, row: Export) -> None:
        try:
            queue_for(self.settings).enqueue(
                EXPORT_TASK,
                row.job_id,
                row.id,
                job_id=rq_job_id(row.id),
                job_timeout=-1,
                result_ttl=86400,
                failure_ttl=7 * 86400,
            )
        except Exception as exc:  # noqa: BLE001 - any Redis failure: say so, and leave no queued ghost
            exports.finish(
                self.session,
                row.id,
                error={"error": "queue_unavailable", "detail": f"could not queue the export: {exc}"},
            )
            self.session.commit()
            raise ServiceUnavailable(
                "the queue is unavailable; try again", error="queue_unavailable"
            ) from exc

    def _requeue_if_lost(self, row: Export) -> None:
        """An export recorded as under way whose RQ job is gone (Redis lost it) or dead is queued again."""
        if row.state not in exports.ACTIVE_STATES:
            return
        try:
            rq_state = RqJob.fetch(rq_job_id(row.id), connection=redis_connection(self.settings)).get_status()
        except NoSuchJobError:
            rq_state = None
        except Exception as exc:  # noqa: BLE001 - cannot tell: leave it, the caller sees its state
            log.warning("could not look up export %s in the queue: %s", row.id, exc)
            return
        if rq_state is None or str(getattr(rq_state, "value", rq_state)) in _DEAD_RQ_STATES:
            log.warning("export %s was %s with no live queue job; queueing it again", row.id, row.state)
            exports.requeue(self.session, row.id)
            self.session.commit()
            self._enqueue(row)


def document(row: Export) -> schemas.ExportOut:
    return schemas.ExportOut.model_validate(row)
