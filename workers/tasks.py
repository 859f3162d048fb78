"""RQ entry points. Plain functions that take ids and open their own sessions; the API enqueues them by
dotted path, so it never imports torch. RQ only wakes workers: the job table says what is left to do."""

from __future__ import annotations

import logging

from hsx.settings import get_settings

log = logging.getLogger(__name__)


def run_next_unit(job_id: str) -> str:
    """Process one work unit of a job (starting the job first if it is still queued), then wake the next."""
    from workers.job_runner import JobRunner

    settings = get_settings()
    outcome = JobRunner(job_id, settings).run_one()
    if outcome.more_work:
        from hsx.jobs.queue import enqueue_wakeups

        enqueue_wakeups(settings, job_id, 1)
    return outcome.summary
