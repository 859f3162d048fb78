"""A job's output in the object store (its ``output_uri``, from ``HSX_OUTPUT_URI`` at submission),
published unit by unit.

* The worker that commits a unit puts the unit's shard right after the commit and records it
  (``shards.published_at``). A consumer is handed a shard of such a job only from then on, with its
  ``uri``, so a reader on another host never waits on an object that is not there.
* A shard whose publisher died or failed is put by the reconciler once it was committed more than a unit
  lease ago, and by finalize whatever its age. Finalize puts the manifest last, so a reader that finds the
  manifest finds every shard (in consume retention, every shard not yet acknowledged: an acknowledged
  one is deleted from the store as from the disk).
* Putting an object is idempotent (a confirmed object is skipped, an unfinished multipart upload is
  continued), so two publishers of one shard are harmless, and one killed mid-upload leaves nothing under
  the shard's key. A publisher that finishes after the shard was already recorded, acknowledged and
  deleted deletes the copy it put back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from hsx.manifest import relative_shard_path
from hsx.server.db.models import Job, JobState, Shard
from hsx.server.db.session import retry_db, session_scope
from hsx.server.job_options import JobOptions
from hsx.server.jobs import queries
from hsx.server.jobs import repository as repo
from hsx.server.jobs.unit_results import mark_published
from hsx.server.settings import Settings
from hsx.streams.contract import KEEP

if TYPE_CHECKING:
    from hsx.server.storage.upload import ObjectReport, UploadEvent

log = logging.getLogger(__name__)


class PublicationFailed(Exception):
    """Publishing again will not help (the store refuses, a shard fails its checksums): the job fails."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Published:
    objects: int = 0
    already_there: int = 0
    parts_reused: int = 0

    def add(self, report: ObjectReport) -> None:
        self.objects += 1
        self.already_there += int(report.already_there)
        self.parts_reused += report.parts_reused

    def __str__(self) -> str:
        reused = f"{self.already_there} already there, {self.parts_reused} parts reused"
        return f"{self.objects} objects ({reused})"


def new_destination(job_id: str, settings: Settings) -> str:
    """A new job's destination, fixed at submission: ``<HSX_OUTPUT_URI>/<job id>``, or "" for none."""
    base = settings.output_uri.rstrip("/")
    return f"{base}/{job_id}" if base else ""


def destination_of(job: Job, settings: Settings) -> str:
    if job.output_uri is not None:
        return job.output_uri
    # Submitted before the destination was recorded with the job: the setting decides at finalize, as it
    # did then (never for a consume job, whose acknowledged shards are gone by finalize).
    legacy = JobOptions.from_stored(job.options).retention == KEEP
    return new_destination(job.id, settings) if legacy else ""


def shard_key(output_dir: str, path: str) -> str:
    """A shard's name under the job's destination: its path in the output directory, as in the manifest."""
    return relative_shard_path(Path(output_dir), Path(path))


def shard_uri(destination: str, output_dir: str, path: str) -> str:
    return f"{destination}/{shard_key(output_dir, path)}"


def publish_pending(
    db_url: str,
    job_id: str,
    settings: Settings,
    *,
    unit_id: int | None = None,
    committed_before: float | None = None,
) -> Published:
    """Put the job's shards not yet confirmed in its store (all, one unit's, or those committed before an
    epoch time), each checked against its recorded checksums first, and record each. Raises
    :class:`~hsx.s3.StorageError` ``unreachable`` (try later) or :class:`PublicationFailed`."""
    from hsx.loader import LoaderError, ShardView
    from hsx.manifest import ShardEntry
    from hsx.s3 import StorageError
    from hsx.server.jobs.manifests import manifest_of
    from hsx.server.storage.publish import put_shard

    def pending() -> tuple[Job | None, list[Shard]]:
        with session_scope(db_url) as session:  # rows stay readable after it (no expiry on commit)
            job = repo.get_job(session, job_id)
            if job is None or not destination_of(job, settings):
                return None, []
            return job, queries.unpublished_shards(session, job_id, unit_id)

    job, shards = retry_db(pending)
    if committed_before is not None:
        shards = [s for s in shards if _epoch(s.created_at) < committed_before]
    done = Published()
    if job is None or not shards:
        return done
    destination = destination_of(job, settings)
    layout = manifest_of(job, [])  # what the shards are checked against, as finalize will list them
    for shard in shards:
        path = Path(shard.path)
        relative = shard_key(job.output_dir, shard.path)
        entry = ShardEntry(
            relative, shard.sha256, shard.bytes, shard.samples, shard.tokens, shard.header_sha256
        )
        try:
            ShardView(path, entry, layout, verify=True)  # never publish a shard that fails its checksums
            report = put_shard(path, relative, destination, settings, progress=crash_mid_publish)
        except (StorageError, LoaderError, OSError) as exc:
            if retry_db(lambda shard_id=shard.id: _recorded(db_url, shard_id)):
                continue  # another publisher got there (and a consumer may have had it deleted since)
            if isinstance(exc, StorageError) and exc.error == "unreachable":
                raise
            detail = exc.detail if isinstance(exc, StorageError) else str(exc)
            raise PublicationFailed(f"could not publish {relative} to {destination}: {detail}") from exc
        done.add(report)
        _record(db_url, shard.id, destination, relative, settings)
    return done


def publish_committed(db_url: str, job_id: str, unit_id: int, settings: Settings) -> None:
    """Called by the worker that committed the unit, right after the commit. Best effort: a shard left
    unpublished is put by the reconciler or by finalize (which fail the job if the store refuses it)."""
    try:
        publish_pending(db_url, job_id, settings, unit_id=unit_id)
    except Exception as exc:  # noqa: BLE001 - the unit is committed; its publication is retried elsewhere
        log.warning("job %s: the shard of unit id %s is not published yet: %s", job_id, unit_id, exc)


def publish_stragglers(settings: Settings, job_id: str, now: float) -> int:
    """The reconciler's part: shards committed more than a unit lease ago and still not in the store
    (their publisher died or failed), put now; the job fails if the store refuses them for good."""
    from hsx.s3 import StorageError

    db_url = settings.resolved_database_url
    try:
        done = publish_pending(db_url, job_id, settings, committed_before=now - settings.lease_seconds)
    except PublicationFailed as exc:
        with session_scope(db_url) as session:
            running = [JobState.running.value]
            if repo.set_job_state(session, job_id, JobState.failed, running, error=exc.reason):
                log.error("job %s failed: %s", job_id, exc.reason)
        return 0
    except StorageError as exc:
        log.warning("job %s: shards not published yet: %s", job_id, exc)
        return 0
    if done.objects:
        log.info("job %s: published %s left behind by their committers", job_id, done)
    return done.objects


def _record(db_url: str, shard_id: int, destination: str, relative: str, settings: Settings) -> None:
    from hsx.s3 import StorageError
    from hsx.server.storage.publish import delete_objects

    def mark() -> bool:
        with session_scope(db_url) as session:
            if mark_published(session, shard_id, time.time()):
                return False
            return queries.shard_deleted(session, shard_id)

    if retry_db(mark):
        # Recorded by another publisher, acknowledged and deleted before this upload finished: this
        # upload put it back, so it goes again (nothing unacknowledged is ever deleted).
        try:
            delete_objects(destination, [relative], settings)
        except StorageError as exc:  # an object left over costs storage, never a sample
            log.warning("%s/%s was acknowledged and put back; not deleted: %s", destination, relative, exc)


def _recorded(db_url: str, shard_id: int) -> bool:
    with session_scope(db_url) as session:
        return queries.shard_published(session, shard_id)


def crash_mid_publish(event: UploadEvent) -> None:
    """The fault tests' ``HSX_CRASH_AT=mid_publish``: dies after a part or an object went up."""
    from hsx.server.faults import crash_point

    crash_point("mid_publish")


def _epoch(moment: datetime) -> float:
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()
