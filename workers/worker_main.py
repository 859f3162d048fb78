"""``hsx worker``: an RQ worker that runs one work unit per RQ job, plus the reconciler.

SIGTERM is a warm shutdown: RQ lets the unit in hand finish (its horse runs in its own process group, so
the signal does not reach it), then the worker exits 0. A horse that dies has its leases ended at once so
another attempt can take the unit without waiting for the lease to run out.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from rq import Worker

from hsx.jobs.queue import queue_for, redis_connection
from hsx.settings import Settings, get_settings
from workers.reconciler import ReconcilerThread, expire_leases_of

log = logging.getLogger(__name__)


class HsxWorker(Worker):
    def handle_work_horse_killed(self, job: Any, retpid: int, ret_val: int, rusage: Any) -> None:
        super().handle_work_horse_killed(job, retpid, ret_val, rusage)  # type: ignore[no-untyped-call]
        owner = f"{socket.gethostname()}:{retpid}@{get_settings().engine_url}"  # as JobRunner names it
        try:
            n = expire_leases_of(get_settings().resolved_database_url, owner)
            log.warning("work horse %s died (status %s); released %d lease(s)", retpid, ret_val, n)
        except Exception as exc:  # noqa: BLE001 - the leases still expire on their own
            log.warning("could not release leases of dead horse %s: %s", retpid, exc)


def preload() -> None:
    """Import the heavy modules once in the parent so every forked horse starts warm."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers  # noqa: F401

    # Loading any tokenizer imports a model's configuration module, which pulls in transformers' model
    # machinery (and torch.distributed): seconds of imports that every horse would otherwise pay per unit.
    import transformers.modeling_utils  # noqa: F401

    import workers.chat  # noqa: F401
    import workers.job_runner  # noqa: F401


def run_worker(settings: Settings, burst: bool = False, reconcile: bool = True) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    preload()
    connection = redis_connection(settings)
    worker = HsxWorker([queue_for(settings, connection)], connection=connection)
    reconciler = ReconcilerThread(settings) if reconcile else None
    if reconciler is not None:
        reconciler.start()
    try:
        worker.work(burst=burst, logging_level="INFO", with_scheduler=False)
    finally:
        if reconciler is not None:
            reconciler.stopped.set()
    return 0
