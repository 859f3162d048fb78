"""A wake-up's units, one after another: claim the next (under a consume job's byte cap, deleting what
consumers acknowledged to make room), run the attempt (:mod:`workers.unit_attempt`), until no unit is left
to claim, the worker is asked to stop, or the attempt says this worker should take no more.

Each claim that leaves more work behind makes sure a wake-up is waiting in the queue, so every idle worker
joins in. A claim the cap refuses waits a while on the job's stream news for room
(:func:`hsx.server.streams.news.wait_blocking`) before it gives the job up. The job is finalized by whichever
worker finds nothing left to claim.
"""

from __future__ import annotations

import logging
import threading
import time

from hsx.server import telemetry
from hsx.server.db.models import JobState
from hsx.server.db.session import retry_db, session_scope
from hsx.server.faults import crash_point
from hsx.server.jobs import queries
from hsx.server.jobs import repository as repo
from hsx.server.jobs.finalize import finalize_if_complete
from hsx.server.jobs.queue import wake_idle_workers
from hsx.server.jobs.repository import ClaimedUnit
from hsx.server.logging_setup import log_context
from hsx.server.settings import Settings
from hsx.server.streams import news
from hsx.server.streams import service as stream_service
from hsx.server.streams.deletion import BackgroundDeletion
from workers.engine_gate import EngineGate
from workers.job_view import Outcome
from workers.unit_attempt import UnitAttempt, rounded
from workers.unit_pipeline import UnitPipeline

log = logging.getLogger(__name__)

# Set in a work horse when its worker is asked to stop: the unit in hand finishes, no new one is claimed.
SHUTDOWN = threading.Event()


class UnitLoop:
    def __init__(self, job_id: str, settings: Settings, owner: str, consume: bool) -> None:
        self.job_id = job_id
        self.settings = settings
        self.db_url = settings.resolved_database_url
        self.owner = owner
        self.consume = consume

    def run(self, pipeline: UnitPipeline, gate: EngineGate, max_units: int | None) -> Outcome:
        attempt = UnitAttempt(self.job_id, self.settings, pipeline, gate, pipeline.plan.info, self.wake_more)
        # This host holds the shards: it deletes what consumers acknowledged, which is what makes room under
        # a consume job's cap (the API only records acknowledgements).
        deletion = BackgroundDeletion(self.db_url, self.job_id, self.settings)
        try:
            return self._units(attempt, max_units, deletion)
        finally:
            deletion.wait()  # no thread outlives the loop

    def _units(self, attempt: UnitAttempt, max_units: int | None, deletion: BackgroundDeletion) -> Outcome:
        # Seconds before the next unit: waiting for the deletion, claiming it, waiting for room under a
        # consume job's cap, waking other workers. The unit's log line carries them beside its own
        # (bench/harness.py's timeline).
        before = {"delete_s": 0.0, "claim_s": 0.0, "room_wait_s": 0.0, "wake_s": 0.0}
        done_here = 0
        tight = False  # the cap has refused a claim: from then on delete before each claim, not beside a unit
        while max_units is None or done_here < max_units:
            if SHUTDOWN.is_set():
                return Outcome(f"stopping after {done_here} unit(s)", True)
            deleting = time.monotonic()
            deletion.wait()
            if tight:
                deletion.now()
            before["delete_s"] += time.monotonic() - deleting
            claiming = time.monotonic()
            unit, capped = retry_db(lambda: self._claim())
            before["claim_s"] += time.monotonic() - claiming
            if capped:
                tight, deleting = True, time.monotonic()
                freed = deletion.now()  # the room the cap wants may be acknowledged shards still on disk
                before["delete_s"] += time.monotonic() - deleting
                if freed:
                    continue
                waiting = time.monotonic()
                held_back = news.wait_blocking(
                    self.settings,
                    self.job_id,
                    self.settings.stream_room_wait_seconds,
                    lambda: self._held_back(deletion),
                )
                before["room_wait_s"] += time.monotonic() - waiting
                if not held_back:
                    continue
                # No wake-up is queued: the acknowledgement that makes room wakes a worker (backpressure).
                summary = f"{done_here} unit(s); waiting for consumers under the byte cap"
                with log_context(job_id=self.job_id):
                    log.info("job %s: %s", self.job_id, summary, extra=rounded(before))
                return Outcome(summary, False)
            if unit is None:
                finished = retry_db(lambda: self._finalize())
                return Outcome(f"{done_here} unit(s); no unit left to claim", not finished)
            crash_point("after_claim")
            if self.consume and not tight:
                deletion.start()
            waking = time.monotonic()
            self.wake_more()
            before["wake_s"] = time.monotonic() - waking
            with log_context(job_id=unit.job_id, unit=unit.unit_index, attempt=unit.attempt):
                log.info("job %s: claimed unit %s", self.job_id, unit.unit_index)
                outcome = attempt.run(unit)
                timing = {**rounded(before), **(outcome.timing or {})}
                log.info("job %s: %s", self.job_id, outcome.summary, extra=timing)
                before = dict.fromkeys(before, 0.0)
            telemetry.flush()  # a looping horse's numbers show up unit by unit, not when it exits
            done_here += 1
            if not outcome.more_work:
                return outcome
        return Outcome(f"{done_here} unit(s)", True)

    def _claim(self) -> tuple[ClaimedUnit | None, bool]:
        """The next unit, or None; and whether a consume job's byte cap held a claimable one back."""
        with session_scope(self.db_url) as session:
            if queries.job_state(session, self.job_id) != JobState.running.value:
                return None, False
            now = time.time()
            if not stream_service.may_claim(session, self.job_id, self.settings, now):
                # Nothing left to claim is no wait: the job may be ready to finalize.
                return None, queries.claimable_count(session, self.job_id, now) > 0
            return repo.claim_unit(session, self.job_id, self.owner, self.settings.lease_seconds, now), False

    def _held_back(self, deletion: BackgroundDeletion) -> bool:
        """Whether the cap still holds the next unit back, once what consumers acknowledged is deleted here
        (a worker asked to stop waits no longer: the loop returns before it claims again)."""
        if SHUTDOWN.is_set():
            return False
        deletion.now()

        def look() -> bool:
            with session_scope(self.db_url) as session:
                return stream_service.cap_holds_back(session, self.job_id, self.settings, time.time())

        return bool(retry_db(look))

    def wake_more(self) -> None:
        """Keep a wake-up waiting for every idle worker while units are claimable, so they all join at
        once (best effort: the reconciler keeps one queued from the job table whatever Redis lost)."""
        try:
            with session_scope(self.db_url) as session:
                claimable = stream_service.wakeable_units(session, self.job_id, self.settings, time.time())
            wake_idle_workers(self.settings, self.job_id, claimable)
        except Exception as exc:  # noqa: BLE001 - waking others is never worth failing this unit
            log.warning("could not wake more workers for job %s: %s", self.job_id, exc)

    def _finalize(self) -> bool:
        finished = finalize_if_complete(self.db_url, self.job_id)
        if finished:
            news.announce(self.settings, self.job_id)  # waiting leases learn that the stream ends
        return finished
