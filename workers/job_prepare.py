"""A job's first step, done once by one worker under a lease of its own: turn the dataset into local
records, plan the units (each with its byte range) and project the output's size, in one pass over the
records. A job whose projected output does not fit in the output filesystem is refused here, with the
figures, instead of failing on a full disk hours later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from hsx.contract import EngineInfo
from hsx.server.db.session import session_scope
from hsx.server.ingest import DatasetError, prepare
from hsx.server.job_options import JobOptions
from hsx.server.jobs import recovery
from hsx.server.jobs import repository as repo
from hsx.server.settings import Settings
from workers.output_size import OutputProjector, Projection, free_bytes

log = logging.getLogger(__name__)


class JobPreparer:
    def __init__(self, job_id: str, settings: Settings, owner: str) -> None:
        self.job_id = job_id
        self.settings = settings
        self.owner = owner
        self.db_url = settings.resolved_database_url

    def prepare(
        self,
        dataset: str,
        output_dir: str,
        options: JobOptions,
        info: EngineInfo,
        encoder: Callable[[], Any],
    ) -> bool:
        """Prepare the job; False when this worker did not (another prepares it, or the job failed here,
        saying why). ``encoder`` makes the job's chat encoder, to count a sample of chat records."""
        with session_scope(self.db_url) as session:
            if not repo.begin_prepare(
                session, self.job_id, self.owner, self.settings.lease_seconds, time.time()
            ):
                return False
        per_unit = options.unit_size
        projector = OutputProjector(
            info,
            options.max_length,
            options.truncation,
            encoder,
            self.settings.projection_sample_records,
            store_fp8=options.stores_fp8,
        )
        try:
            with self._lease():
                prepared = prepare(dataset, output_dir, per_unit, self.settings, projector.observe)
                projection = projector.finish(len(prepared.units))
        except DatasetError as exc:
            return self._fail(f"dataset {exc.reason}: {exc.detail}")
        except OSError as exc:
            return self._fail(f"could not prepare the dataset {dataset}: {exc.strerror or exc}")
        if prepared.samples == 0:
            return self._fail("the dataset holds no samples")
        if self.settings.check_output_space:
            projection = replace(projection, free_bytes=free_bytes(output_dir))
            refusal = _no_room(projection, output_dir)
            if refusal:
                return self._fail(refusal)
        units = [(u.sample_start, u.sample_end, u.byte_start, u.byte_end) for u in prepared.units]
        with session_scope(self.db_url) as session:
            done = repo.record_prepared(
                session, self.job_id, self.owner, prepared.path, prepared.bytes, units, projection.to_dict()
            )
        log.info(
            "job %s prepared: %d samples in %d units, output projected at %d bytes (%s)",
            self.job_id,
            prepared.samples,
            len(units),
            projection.bytes,
            projection.basis,
        )
        return bool(done)

    def _fail(self, reason: str) -> bool:
        log.error("job %s failed: %s", self.job_id, reason)
        with session_scope(self.db_url) as session:
            recovery.fail_preparing_job(session, self.job_id, self.owner, reason)
        return False

    @contextmanager
    def _lease(self) -> Iterator[None]:
        """Keeps the prepare lease alive while a large dataset is converted and scanned."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.settings.heartbeat_seconds):
                try:
                    with session_scope(self.db_url) as session:
                        repo.begin_prepare(
                            session, self.job_id, self.owner, self.settings.lease_seconds, time.time()
                        )
                except Exception as exc:  # noqa: BLE001 - the fence in record_prepared decides
                    log.warning("prepare heartbeat failed: %s", exc)

        thread = threading.Thread(target=beat, name="prepare-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=self.settings.heartbeat_seconds + 5)


def _no_room(projection: Projection, output_dir: str) -> str | None:
    if projection.free_bytes is None or projection.bytes <= projection.free_bytes:
        return None
    kind = "exactly" if projection.exact else "about"
    return (
        f"not enough space for the output in {output_dir}: the job needs {kind} {projection.bytes} bytes "
        f"({projection.basis}) and {projection.free_bytes} are free"
    )
