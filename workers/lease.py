"""Keeps a unit's lease alive from a background thread and notices when it is lost or the job is stopped.

Each beat also writes what the attempt has handled so far, so a job's progress moves before its units
commit (the committed counters stay exact; these are shown beside them)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hsx.server.db.models import JobState
from hsx.server.db.session import session_scope
from hsx.server.jobs import queries
from hsx.server.jobs import repository as repo
from hsx.server.jobs.repository import ClaimedUnit, LiveCounts
from hsx.server.jobs.unit_results import unit_committed_by

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(
        self,
        db_url: str,
        unit: ClaimedUnit,
        lease_seconds: float,
        interval: float,
        live: Callable[[], LiveCounts] | None = None,
    ) -> None:
        self.db_url = db_url
        self.unit = unit
        self.live = live
        self.lease_seconds = lease_seconds
        self.interval = interval
        self.lost = threading.Event()
        self.job_stopped = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lease-{unit.id}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)

    @property
    def should_stop(self) -> bool:
        return self.lost.is_set() or self.job_stopped.is_set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with session_scope(self.db_url) as session:
                    counts = self.live() if self.live is not None else None
                    if not repo.extend_lease(session, self.unit, self.lease_seconds, time.time(), counts):
                        # A beat landing just after this attempt's own commit finds the unit done: not a loss.
                        if not unit_committed_by(session, self.unit):
                            log.warning("lease on unit %s attempt %s lost", self.unit.id, self.unit.attempt)
                        self.lost.set()
                        return
                    state = queries.job_state(session, self.unit.job_id)
                if state != JobState.running.value:
                    self.job_stopped.set()
                    return
            except Exception as exc:  # noqa: BLE001 - a database blip is retried; the commit fence decides
                log.warning("heartbeat for unit %s failed: %s", self.unit.id, exc)
