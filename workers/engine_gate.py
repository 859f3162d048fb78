"""Whether this worker's engine may work on a job, decided before it takes a unit and written to the job.

A worker whose engine is unfit for a job (see :mod:`hsx.engine.fitness`) or does not answer takes no unit
of it: it notes why in the job's engine list and leaves the units to healthy workers. A job none of whose
engines has been fit for ``HSX_NO_FIT_ENGINE_SECONDS`` (and that no worker holds a lease on) fails, naming
them, instead of waiting for good. The preflight (``hsx verify``) runs once per job and engine identity:
the first worker runs it before starting the job, a joining worker before its first unit.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import OperationalError

from hsx.contract import EngineInfo
from hsx.engine import fitness as engine_fitness
from hsx.server.db.models import JobState
from hsx.server.db.session import session_scope
from hsx.server.job_options import JobOptions
from hsx.server.jobs import engines_met, queries
from hsx.server.jobs import repository as repo
from hsx.server.retry import DATABASE
from hsx.server.settings import Settings
from workers.job_view import Outcome

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refusal:
    state: str  # engines_met.UNFIT or UNAVAILABLE
    reason: str
    job_failed: str | None  # the job's error when this refusal ended the job

    def outcome(self) -> Outcome:
        """What the wake-up reports: this worker takes no more units of the job."""
        ended = f"; the job failed: {self.job_failed}" if self.job_failed else ""
        return Outcome(f"engine {self.state}: {self.reason}{ended}", False)


class EngineGate:
    def __init__(self, job_id: str, settings: Settings, engine_url: str) -> None:
        self.job_id = job_id
        self.settings = settings
        self.db_url = settings.resolved_database_url
        self.url = engine_url
        self.worker = socket.gethostname()

    def _entry(self, state: str, reason: str | None, info: EngineInfo | None, **extra: Any) -> dict[str, Any]:
        now = time.time()
        entry: dict[str, Any] = {
            "worker": self.worker,
            "url": self.url,
            "state": state,
            "reason": reason,
            "since": now,
            "seen": now,
        }
        if info is not None:
            entry.update(backend=info.backend, model_fingerprint=info.model_fingerprint)
        entry.update(extra)
        return entry

    def previous(self) -> dict[str, Any] | None:
        with session_scope(self.db_url) as session:
            job = repo.get_job(session, self.job_id)
            entries = job.engines if job is not None else None
        return engines_met.entry_of(entries, self.worker, self.url)

    def verified(self, identity: str) -> bool:
        """Whether a preflight already passed for this job on an engine of exactly this identity."""
        entry = self.previous()
        return bool(entry and entry.get("verified") and entry.get("identity") == identity)

    def accept(self, info: EngineInfo, identity: str) -> None:
        """This engine passed the preflight for the job (now or earlier) and takes its units."""
        entry = self._entry(engines_met.OK, None, info, identity=identity, verified=True)
        self._note(entry)

    def refuse(self, state: str, reason: str, info: EngineInfo | None = None) -> Refusal:
        """Note why this engine takes no unit; fail the job when no engine has been fit for too long."""
        log.warning("job %s: engine %s is %s: %s", self.job_id, self.url, state, reason)
        window = self.settings.no_fit_engine_seconds

        def note() -> str | None:
            with session_scope(self.db_url) as session:
                entries = engines_met.note_engine(session, self.job_id, self._entry(state, reason, info))
                live = queries.live_lease_count(session, self.job_id, time.time())
                stop = engines_met.no_fit_engine(entries, live, time.time(), window)
                if stop is not None and repo.set_job_state(
                    session, self.job_id, JobState.failed, repo.ACTIVE_STATES, error=stop
                ):
                    return stop
            return None

        try:
            stopped = DATABASE.call(note, (OperationalError,), "noting an unfit engine")
        except Exception as exc:  # noqa: BLE001 - the refusal stands whether or not it was written
            log.warning("could not note engine %s on job %s: %s", self.url, self.job_id, exc)
            stopped = None
        if stopped:
            log.error("job %s failed: %s", self.job_id, stopped)
        return Refusal(state, reason, stopped)

    def _note(self, entry: dict[str, Any]) -> None:
        def note() -> None:
            with session_scope(self.db_url) as session:
                engines_met.note_engine(session, self.job_id, entry)

        try:
            DATABASE.call(note, (OperationalError,), "noting an engine")
        except Exception as exc:  # noqa: BLE001 - the list is informational; units are fenced anyway
            log.warning("could not note engine %s on job %s: %s", self.url, self.job_id, exc)


def static_problem(info: EngineInfo, options: JobOptions, job_engine: dict[str, Any] | None) -> str | None:
    """What unfits the engine before any tokenizer is loaded."""
    problems = [p for p in [engine_fitness.protocol_problem(info)] if p]
    problems += engine_fitness.option_problems(info, options)
    if job_engine:
        problems += engine_fitness.identity_problems(job_engine, info)
    return "; ".join(problems) or None
