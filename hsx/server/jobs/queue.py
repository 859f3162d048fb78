"""Waking workers through RQ. Jobs are enqueued by dotted path so that the API never imports torch."""

from __future__ import annotations

import logging
import uuid

from redis import Redis
from rq import Queue

from hsx.server.redis_clients import redis_connection
from hsx.server.settings import Settings

log = logging.getLogger(__name__)

# The RQ tasks (workers.tasks), by dotted path.
EXTRACTION_TASK = "workers.tasks.extraction.work_on_job"
EXPORT_TASK = "workers.tasks.export.run_export"
VERIFY_TASK = "workers.tasks.verify.run_verify"
WAKEUP_PREFIX = "hsx-wake-"


def queue_for(settings: Settings, connection: Redis | None = None) -> Queue:
    return Queue(settings.queue_name, connection=connection or redis_connection(settings))


def enqueue_wakeups(settings: Settings, job_id: str, count: int) -> int:
    """Enqueue ``count`` wake-ups for a job. A failure is logged, not raised: the job row is already
    committed and the reconciler re-enqueues any job that has work and no live lease."""
    try:
        queue = queue_for(settings)
        for _ in range(count):
            queue.enqueue(
                EXTRACTION_TASK,
                job_id,
                job_id=f"{WAKEUP_PREFIX}{job_id}-{uuid.uuid4().hex[:12]}",
                job_timeout=-1,
                result_ttl=600,
                failure_ttl=7 * 86400,
            )
        return count
    except Exception as exc:  # noqa: BLE001 - the reconciler is the safety net for any Redis failure
        log.warning("could not enqueue wake-ups for job %s: %s", job_id, exc)
        return 0


def queued_wakeups(settings: Settings, job_id: str) -> int:
    queue = queue_for(settings)
    prefix = f"{WAKEUP_PREFIX}{job_id}-"
    return sum(1 for jid in queue.get_job_ids() if jid.startswith(prefix))


def idle_workers(settings: Settings) -> int:
    """Workers registered on the queue and waiting for work (RQ's own registry)."""
    from rq import Worker

    queue = queue_for(settings)
    return sum(1 for worker in Worker.all(queue=queue) if worker.get_state() == "idle")


def wake_idle_workers(settings: Settings, job_id: str, claimable: int, joining: int = 0) -> int:
    """Make sure enough wake-ups wait for a job with ``claimable`` units: one per idle worker, plus
    ``joining`` for workers about to register, so they all join at once rather than one after another; at
    least one, whatever the registry says (a worker may be starting). Returns how many were enqueued."""
    if claimable <= 0:
        return 0
    wanted = min(claimable, max(1, idle_workers(settings) + joining))
    missing = wanted - queued_wakeups(settings, job_id)
    return enqueue_wakeups(settings, job_id, missing) if missing > 0 else 0
