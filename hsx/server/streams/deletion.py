"""Deleting a consume job's acknowledged shards, on the hosts that hold them.

The API only records acknowledgements: it may see the output read-only (docker-compose.yml mounts it so)
or not at all (workers on other hosts). The workers delete: each one before it claims a unit of a consume
job (so a worker waiting for room under the cap frees the room it waits for), and the reconciler in every
worker host, for jobs in any state (the last shards are acknowledged after the job has succeeded, when no
unit is left to claim). An item is recorded as deleted only once its file is gone from this host's view of
the output, and its object too when the job publishes to an object store; until then it counts against
the cap, and the next pass tries again. Every step is idempotent, so any number of workers may run it at
once."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from hsx.server.db.session import retry_db, session_scope
from hsx.server.jobs import repository as jobs_repo
from hsx.server.jobs.publication import destination_of, shard_key
from hsx.server.settings import Settings
from hsx.server.streams import repository as repo
from hsx.server.streams.service import retention_of
from hsx.streams.contract import CONSUME

log = logging.getLogger(__name__)


def delete_acknowledged(db_url: str, job_id: str, settings: Settings) -> int:
    """Delete the shards of the job's acknowledged items not deleted yet (and only those) and record each
    that is gone. Returns how many were recorded. Does nothing on a host that does not see the job's output
    directory: the job's workers share it (they read the prepared records from it), so a host that sees it
    sees every shard, and a shard missing there is gone."""

    def pending() -> tuple[list[tuple[int, str]], str, str]:
        with session_scope(db_url) as session:
            job = jobs_repo.get_job(session, job_id)
            if job is None or retention_of(job.options) != CONSUME:
                return [], "", ""
            return repo.acked_undeleted(session, job_id), job.output_dir, destination_of(job, settings)

    acked, output_dir, destination = retry_db(pending)
    if not acked or not Path(output_dir).is_dir():
        return 0
    gone: list[int] = []
    for item_id, path in acked:
        try:
            Path(path).unlink()
        except FileNotFoundError:
            pass  # deleted by another worker, or by a pass that died before recording it
        except OSError as exc:  # a read-only or failing disk: the shard stays counted, and is tried again
            log.warning("job %s: could not delete acknowledged shard %s: %s", job_id, path, exc)
            continue
        gone.append(item_id)
    if destination and gone:
        gone = _delete_objects(job_id, destination, output_dir, dict(acked), gone, settings)
    if gone:

        def record() -> None:
            with session_scope(db_url) as session:
                repo.mark_deleted(session, gone, time.time())

        retry_db(record)
    return len(gone)


def _delete_objects(
    job_id: str, destination: str, output_dir: str, paths: dict[int, str], gone: list[int], settings: Settings
) -> list[int]:
    """Of ``gone`` (files deleted), the items whose object is deleted from the store too. An object the
    store would not delete stays recorded as not gone, so the next pass tries again."""
    from hsx.s3 import StorageError
    from hsx.server.storage.publish import delete_objects

    keys = {shard_key(output_dir, paths[item_id]): item_id for item_id in gone}
    try:
        deleted = set(delete_objects(destination, list(keys), settings))
    except StorageError as exc:
        log.warning("job %s: acknowledged objects not deleted yet: %s", job_id, exc)
        return []
    return [item_id for key, item_id in keys.items() if key in deleted]


def delete_acknowledged_or_log(db_url: str, job_id: str, settings: Settings) -> int:
    """:func:`delete_acknowledged` for callers that must go on whatever happens: a worker about to claim,
    the reconciler. A shard not deleted stays counted, and the next pass tries again."""
    try:
        return delete_acknowledged(db_url, job_id, settings)
    except Exception as exc:  # noqa: BLE001 - deleting is retried at every claim and reconciler pass
        log.warning("job %s: acknowledged shards not deleted: %s", job_id, exc)
        return 0


def delete_all_acknowledged(settings: Settings) -> int:
    """The reconciler's part: every job's acknowledged shards not deleted yet, whatever the job's state."""
    db_url = settings.resolved_database_url

    def jobs() -> list[str]:
        with session_scope(db_url) as session:
            return repo.consume_jobs_with_acked_undeleted(session)

    return sum(delete_acknowledged_or_log(db_url, job_id, settings) for job_id in retry_db(jobs))


class BackgroundDeletion:
    """A worker's deletion of a consume job's acknowledged shards, off its path to the engine: started when
    a unit is claimed, it runs while the unit's prefills do (on a GPU host the worker mostly waits for the
    engine then), and the next claim waits for it first. Unlinking a shard frees its page-cache pages, which
    took 7 to 11% of the workers' time when it ran before every claim (bench/RESULTS.md). A claim the cap
    refuses deletes at once (:meth:`now`), so the room an acknowledgement made is never missed, and from
    then on the worker deletes before each claim, as the cap binds: a background pass would leave the next
    claim to find acknowledged shards still counted and be refused once more."""

    def __init__(self, db_url: str, job_id: str, settings: Settings) -> None:
        self.db_url, self.job_id, self.settings = db_url, job_id, settings
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.wait()
        self.thread = threading.Thread(target=self.now, name=f"hsx-delete-{self.job_id[:8]}", daemon=True)
        self.thread.start()

    def now(self) -> int:
        return delete_acknowledged_or_log(self.db_url, self.job_id, self.settings)

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
