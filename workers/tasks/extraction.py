"""The RQ entry point of extraction: ``work_on_job(job_id)``, enqueued as a wake-up (hsx.server.jobs.queue).
RQ only wakes workers: the job table says what is left to do."""

from __future__ import annotations

import logging
import signal
import threading

from hsx.server.settings import get_settings

log = logging.getLogger(__name__)

# The worker sends this to its work horse on a warm shutdown (see workers.worker_main).
STOP_SIGNAL = signal.SIGUSR1


def work_on_job(job_id: str) -> str:
    """Work on a job until no unit is left to claim (preparing or starting it first if it is queued)."""
    from workers.job_runner import JobRunner
    from workers.unit_loop import SHUTDOWN

    if threading.current_thread() is threading.main_thread():
        signal.signal(STOP_SIGNAL, lambda *_: SHUTDOWN.set())
    from hsx.server import telemetry

    settings = get_settings()
    try:
        outcome = JobRunner(job_id, settings).run()
    finally:
        telemetry.flush()  # a work horse leaves with os._exit, which skips atexit
    if outcome.more_work:
        from hsx.server.jobs.queue import enqueue_wakeups

        enqueue_wakeups(settings, job_id, 1)
    return outcome.summary
