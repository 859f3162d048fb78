"""Closing a job: once every unit is done, write the manifest and mark the job succeeded (once)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from hsx.layout import is_temp_name, parse_staged_shard_name
from hsx.server.db.models import JobState, UnitState
from hsx.server.db.session import session_scope
from hsx.server.jobs import queries
from hsx.server.jobs import repository as repo
from hsx.server.jobs.manifests import manifest_of
from hsx.server.jobs.publication import PublicationFailed, crash_mid_publish, destination_of, publish_pending
from hsx.server.settings import get_settings

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"


def finalize_if_complete(db_url: str, job_id: str) -> bool:
    """Returns True when the job is finished (by this call or an earlier one)."""
    with session_scope(db_url) as session:
        job = repo.get_job(session, job_id)
        if job is None or JobState(job.state).is_final:
            return True
        if job.state != JobState.running.value:
            return False
        counts = queries.unit_counts(session, job_id)
        if sum(n for state, n in counts.items() if state != UnitState.done.value):
            return False
        # The job row above was read before the units were counted: the last unit may have committed in
        # between (its counters and its state in one transaction), so read the row again now that every
        # unit is done, or the manifest counts a sample short of its shards.
        session.refresh(job)
        shards = queries.list_shards(session, job_id)
        out = Path(job.output_dir)
        manifest = manifest_of(job, shards)
        published_to = destination_of(job, get_settings())
        if published_to:
            manifest.extra["published_to"] = published_to
        try:
            out.mkdir(parents=True, exist_ok=True)
            _remove_dead_shard_temps(out)
            manifest.write(out)
        except OSError as exc:
            # A full or read-only disk does not heal by retrying at every reconcile pass: fail, saying why.
            reason = f"could not write the manifest in {out}: {exc.strerror or exc}"
            if repo.set_job_state(session, job_id, JobState.failed, [JobState.running.value], error=reason):
                log.error("job %s failed: %s", job_id, reason)
            return True
        if published_to:
            # Succeeded only once every object is confirmed in the store. Shards went up as their units
            # committed; what is left (a publisher that died) goes now, then the manifest. Every upload
            # resumes where it stopped, so a crash here is repaired by the next finalize.
            problem = _publish(db_url, job_id, out, published_to)
            if problem is not None:
                if repo.set_job_state(
                    session, job_id, JobState.failed, [JobState.running.value], error=problem
                ):
                    log.error("job %s failed: %s", job_id, problem)
                return True
        done = repo.set_job_state(session, job_id, JobState.succeeded, [JobState.running.value])
    if done:
        log.info("job %s succeeded", job_id)
    return True


def _publish(db_url: str, job_id: str, out: Path, destination: str) -> str | None:
    """Upload what is left, the manifest last; None when every object is confirmed, else why not (the job
    then fails). An unreachable store raises instead, so the job stays running and the next finalize
    tries again."""
    from hsx.s3 import StorageError
    from hsx.server.storage.publish import put_manifest

    settings = get_settings()
    try:
        done = publish_pending(db_url, job_id, settings)
        done.add(put_manifest(out, destination, settings, progress=crash_mid_publish))
    except PublicationFailed as exc:
        return exc.reason
    except StorageError as exc:
        if exc.error == "unreachable":
            raise
        return f"could not publish the output to {destination}: {exc.detail}"
    log.info("published %s to %s", done, destination)
    return None


def _remove_dead_shard_temps(out: Path) -> None:
    """Every unit is done, so a shard's staged or temp file left here belongs to an attempt that crashed
    (or lost its lease): remove it, or it would stay in the finished output for good."""
    for path in out.iterdir():
        name = path.name
        if parse_staged_shard_name(name) is not None or (name.startswith(".shard-") and is_temp_name(name)):
            with contextlib.suppress(OSError):  # best effort: leftovers must not fail the job
                path.unlink()
