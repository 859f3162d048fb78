"""``POST /verify`` run where the engine's dumps are: on a worker, answered through the queue. The API has no
view of the dumps (docker-compose.yml mounts none into it), so it enqueues the check (by dotted path: the
API imports no worker code), waits a bounded time for the report, and says why when none comes."""

from __future__ import annotations

import time
import uuid
from typing import Any

from rq.job import Job as RqJob
from rq.job import JobStatus

from hsx.errors import HsxError, ServiceUnavailable
from hsx.server.jobs.queue import VERIFY_TASK, queue_for
from hsx.server.settings import Settings

VERIFY_JOB_PREFIX = "hsx-verify-"
_POLL_SECONDS = 0.1
_DEAD = {JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED}


class VerifyUnanswered(HsxError):
    status_code = 504
    error = "verify_unanswered"


def verify_on_worker(settings: Settings, reference: bool = False) -> dict[str, Any]:
    """The report of ``hsx verify`` (``--reference`` too, if asked) against the configured engine, run by a
    worker of this queue."""
    try:
        # At the front: an operator waits for it, and it is two short prefills.
        job = queue_for(settings).enqueue(
            VERIFY_TASK,
            settings.engine_url,
            reference,
            job_id=f"{VERIFY_JOB_PREFIX}{uuid.uuid4().hex}",
            at_front=True,
            job_timeout=int(settings.verify_wait_seconds) + 60,
            result_ttl=600,
            failure_ttl=86400,
        )
    except Exception as exc:  # noqa: BLE001 - any Redis failure is the same answer
        raise ServiceUnavailable(f"the queue is unavailable: {exc}", error="queue_unavailable") from exc
    return _wait(job, settings.verify_wait_seconds)


def _wait(job: RqJob, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        status = job.get_status(refresh=True)
        if status == JobStatus.FINISHED:
            return dict(job.return_value(refresh=True) or {})
        if status in _DEAD:
            raise ServiceUnavailable(
                f"the worker that ran the check failed ({status.value}); its traceback is in RQ's failed "
                f"registry as job {job.id}",
                error="verify_failed_to_run",
            )
        if time.monotonic() > deadline:
            if status == JobStatus.STARTED:
                detail = f"a worker started the check but it did not finish within {seconds:g}s"
            else:
                job.cancel()  # nobody waits for it any more: a worker that frees up later skips it
                detail = (
                    f"no worker took the check within {seconds:g}s: none runs on this queue, or every one is "
                    "busy with a job's units; the check runs on a worker because only workers see the "
                    "engine's dumps"
                )
            raise VerifyUnanswered(f"{detail} (HSX_VERIFY_WAIT_SECONDS)")
        time.sleep(_POLL_SECONDS)
