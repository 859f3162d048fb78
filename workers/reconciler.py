"""The safety net behind RQ: the job table says what is left, so whatever Redis lost, a crashed worker
left behind or a finished-but-not-closed job is found and set right here. Every action is idempotent, so
any number of workers may run it at once."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

from hsx.contract import RID_PREFIX
from hsx.layout import parse_staged_shard_name
from hsx.server.db.models import JobState
from hsx.server.db.session import session_scope
from hsx.server.jobs import queries, recovery
from hsx.server.jobs import repository as repo
from hsx.server.jobs.finalize import finalize_if_complete
from hsx.server.jobs.publication import publish_stragglers
from hsx.server.jobs.queue import wake_idle_workers
from hsx.server.settings import Settings
from hsx.server.streams import service as stream_service
from hsx.server.streams.deletion import delete_all_acknowledged

log = logging.getLogger(__name__)

STALE_DUMP_SECONDS = 600.0
STALE_TEMP_SECONDS = 60.0

# Held for each pass of the reconciler thread; the worker forks its horses only while holding it too. A fork
# copies every lock another thread holds at that instant (a module import's, the connection pool's) into the
# child, where no thread will ever release it: a horse forked mid-pass could hang for good.
FORK_LOCK = threading.Lock()


def expire_leases_of(db_url: str, owner: str, reason: str = "", max_failures: int = 0) -> int:
    """A work horse died: its leases end now instead of at their expiry. With ``max_failures``, each of its
    units counts a failure (``reason``), so a unit that kills every horse that takes it ends, failing its
    job, instead of being retried for ever."""
    with session_scope(db_url) as session:
        if not max_failures:
            return repo.expire_leases_owned_by(session, owner)
        ended = recovery.count_dead_owner_failures(session, owner, reason, max_failures)
    for job_id, unit_index, failed in ended:
        if failed:
            log.error("job %s failed: unit %s at its failure bound (a dead horse)", job_id, unit_index)
    return len(ended)


def reconcile_once(settings: Settings, now: float | None = None) -> dict[str, int]:
    now = time.time() if now is None else now
    db_url = settings.resolved_database_url
    stats = {"woken": 0, "finalized": 0, "published": 0, "deleted": 0, "temp_removed": 0, "dumps_removed": 0}
    # First, so the room it makes is counted below: the last shards of a job are acknowledged after it has
    # succeeded, and a job whose workers all left at its cap has nobody else to delete them.
    stats["deleted"] += delete_all_acknowledged(settings)
    with session_scope(db_url) as session:
        job_ids = queries.active_job_ids(session)
    waking = True  # until Redis fails this pass: the table's own work goes on without it
    for job_id in job_ids:
        with session_scope(db_url) as session:
            job = repo.get_job(session, job_id)
            if job is None:
                continue
            state, output_dir = job.state, job.output_dir
            claimable = stream_service.wakeable_units(session, job_id, settings, now)
            live = queries.live_lease_count(session, job_id, now)
            leased = {(u.unit_index, u.attempt) for u in queries.leased_units(session, job_id)}
        if state == JobState.running.value:
            stats["published"] += publish_stragglers(settings, job_id, now)
        if state == JobState.running.value and claimable == 0 and live == 0 and _finalize(db_url, job_id):
            stats["finalized"] += 1
            continue
        # Work is waiting and nothing in Redis may wake a worker for it (Redis lost it, a worker died,
        # every worker was busy when the last wake-ups were taken, or workers started since): a wake-up
        # waits for every idle worker, and whoever takes one wakes the rest while units stay claimable.
        if waking and (claimable or state == JobState.queued.value):
            try:
                stats["woken"] += wake_idle_workers(settings, job_id, max(claimable, 1))
            except Exception as exc:  # noqa: BLE001 - the next pass wakes them; a hung Redis costs one call
                log.warning("reconciler: no wake-ups this pass, Redis failed: %s", exc)
                waking = False
        stats["temp_removed"] += _remove_stale_temp(Path(output_dir), leased, now)
    stats["dumps_removed"] += _remove_stale_dumps(settings.resolved_dump_dir, now)
    return stats


def _finalize(db_url: str, job_id: str) -> bool:
    """Finalize a job whose units are all done; an unreachable store leaves it running for the next pass,
    without cutting this pass short for the jobs after it."""
    from hsx.s3 import StorageError

    try:
        return finalize_if_complete(db_url, job_id)
    except StorageError as exc:
        if exc.error != "unreachable":
            raise
        log.warning("job %s: not finalized, its store is unreachable: %s", job_id, exc)
        return False


def wake_for_a_new_worker(settings: Settings) -> int:
    """A worker about to start: every job with claimable units gets wake-ups for the idle workers and this
    one, less those already waiting. The others' wake-ups were counted for the workers
    idle at the last claim; without this a late starter would wait for the next reconciler pass."""
    now = time.time()
    with session_scope(settings.resolved_database_url) as session:
        waiting = {
            job_id: queries.claimable_count(session, job_id, now)
            for job_id in queries.active_job_ids(session)
            if queries.job_state(session, job_id) == JobState.running.value
        }
    return sum(wake_idle_workers(settings, job, claimable, joining=1) for job, claimable in waiting.items())


def _remove_stale_temp(output_dir: Path, live: set[tuple[int, int]], now: float) -> int:
    """Staged shards of attempts that no longer hold their unit, and writers' temp files, once old."""
    if not output_dir.is_dir():
        return 0
    removed = 0
    for path in output_dir.iterdir():
        name = path.name
        if not (name.endswith(".staged") or ".tmp" in name):
            continue
        if parse_staged_shard_name(name) in live:
            continue
        try:
            if now - path.stat().st_mtime > STALE_TEMP_SECONDS:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            continue
    return removed


def _remove_stale_dumps(dump_dir: str, now: float) -> int:
    removed = 0
    try:
        entries = list(os.scandir(dump_dir))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if not entry.name.startswith(RID_PREFIX):
            continue
        try:
            if now - entry.stat().st_mtime > STALE_DUMP_SECONDS:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
        except FileNotFoundError:
            continue
    return removed


class ReconcilerThread(threading.Thread):
    def __init__(self, settings: Settings) -> None:
        super().__init__(name="hsx-reconciler", daemon=True)
        self.settings = settings
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.settings.reconcile_seconds):
            try:
                with FORK_LOCK:
                    stats = reconcile_once(self.settings)
                if any(stats.values()):
                    log.info("reconciler: %s", stats)
            except Exception as exc:  # noqa: BLE001 - a pass that fails is retried at the next interval
                log.warning("reconciler pass failed: %s", exc)
