"""One wake-up of a worker for one job: check the engine, prepare or start the job if needed, resolve the
job's plan (:mod:`workers.job_plan`) and install its features (:mod:`workers.features`), then run units
one after another (:mod:`workers.unit_loop`) until no unit is left to claim.

A unit runs as a pipeline (:mod:`workers.unit_pipeline`: read, stages, capture, commit), and every step
that records results names the attempt that owns the unit's lease, so a worker that was frozen or lost can
never commit, and a unit's shard and rejections are recorded exactly once. How an attempt can end, and
what each end does to the unit and the job, is :mod:`workers.unit_attempt`'s.
"""

from __future__ import annotations

import logging
import os
import socket

from hsx import layout
from hsx.contract import EngineInfo
from hsx.engine import fitness as engine_fitness
from hsx.engine.client import EngineClient, EngineUnavailable, EngineUnfit
from hsx.server.db.models import JobState
from hsx.server.db.session import session_scope
from hsx.server.jobs import engines_met
from hsx.server.jobs import repository as repo
from hsx.server.settings import Settings
from workers.engine_gate import EngineGate, Refusal, static_problem
from workers.job_plan import JobPlan, resolve_plan
from workers.job_prepare import JobPreparer
from workers.job_tokenizer import chat_encoder, engine_record, worker_side
from workers.job_view import JobView, Outcome
from workers.unit_loop import UnitLoop
from workers.unit_pipeline import UnitPipeline

log = logging.getLogger(__name__)


def lease_owner(pid: int, engine_url: str) -> str:
    """This host's owner string for process ``pid`` (format: hsx.layout.lease_owner)."""
    return layout.lease_owner(socket.gethostname(), pid, engine_url)


class JobRunner:
    def __init__(self, job_id: str, settings: Settings) -> None:
        self.job_id = job_id
        self.settings = settings
        self.db_url = settings.resolved_database_url
        self.owner = lease_owner(os.getpid(), settings.engine_url)
        self.client = EngineClient(
            settings.engine_url, timeout=settings.engine_timeout_seconds, retries=settings.engine_retries
        )
        self.gate = EngineGate(job_id, settings, settings.engine_url)
        # The identity this wake-up's preflight passed for (the job's start verifies before preparing).
        self._verified_identity: str | None = None

    def _load(self) -> JobView | None:
        with session_scope(self.db_url) as session:
            job = repo.get_job(session, self.job_id)
            return None if job is None else JobView.of(job, self.settings)

    def run(self, max_units: int | None = None) -> Outcome:
        job = self._load()
        if job is None:
            return Outcome("no such job", False)
        if JobState(job.state).is_final:
            return Outcome(f"job is {job.state}", False)
        try:
            info = self.client.info()
        except EngineUnfit as exc:
            return self.gate.refuse(engines_met.UNFIT, str(exc)).outcome()
        except EngineUnavailable as exc:
            return self.gate.refuse(engines_met.UNAVAILABLE, str(exc)).outcome()
        problem = static_problem(info, job.options, job.engine)
        if problem:
            return self.gate.refuse(engines_met.UNFIT, problem, info).outcome()
        if job.state == JobState.queued.value:
            # Verified before the dataset is prepared: an unfit engine leaves the job to another worker.
            refusal = self._verify(info)
            if refusal is not None:
                return refusal.outcome()
            if job.units_total == 0 and not self._prepare(job, info):
                return Outcome("job is being prepared by another worker, or failed", False)
            self._start(info)
            job = self._load()
            if job is None or job.records_path is None:
                return Outcome("job vanished while it was prepared", False)
        refusal = self._join(job, info)
        if refusal is not None:
            return refusal.outcome()
        return self._run_units(job, resolve_plan(job, info, self.settings), max_units)

    def _run_units(self, job: JobView, plan: JobPlan, max_units: int | None) -> Outcome:
        """The job's units under its plan, each through the pipeline with the job's features installed."""
        info = plan.info
        pipeline = UnitPipeline.build(
            self.job_id,
            job,
            plan,
            self.client,
            self.settings,
            lambda: chat_encoder(self.settings, info, job.options),
        )
        try:
            loop = UnitLoop(self.job_id, self.settings, self.owner, plan.consume)
            return loop.run(pipeline, self.gate, max_units)
        finally:
            pipeline.close()

    def _prepare(self, job: JobView, info: EngineInfo) -> bool:
        preparer = JobPreparer(self.job_id, self.settings, self.owner)
        return preparer.prepare(
            job.dataset_path,
            job.output_dir,
            job.options,
            info,
            lambda: chat_encoder(self.settings, info, job.options),
        )

    def _start(self, info: EngineInfo) -> None:
        """Move the (verified, prepared) job from queued to running, bound to this engine's identity. A
        worker that loses this race joins the job like any other, checked against the winner's engine."""
        record = engine_record(self.settings, info)
        with session_scope(self.db_url) as session:
            repo.set_job_state(session, self.job_id, JobState.running, [JobState.queued.value], engine=record)
        self._verified_identity = engine_fitness.identity_digest(info, worker_side(record))

    def _join(self, job: JobView, info: EngineInfo) -> Refusal | None:
        """A running job: this engine (and tokenizer) must be the job's, and verified once for it."""
        ours = worker_side(engine_record(self.settings, info))
        if job.engine:
            problems = engine_fitness.identity_problems(job.engine, info, ours)
            if problems:
                return self.gate.refuse(engines_met.UNFIT, "; ".join(problems), info)
        identity = engine_fitness.identity_digest(info, ours)
        verified = self._verified_identity == identity or self.gate.verified(identity)
        if not verified:
            refusal = self._verify(info)
            if refusal is not None:
                return refusal
        self.gate.accept(info, identity)
        return None

    def _verify(self, info: EngineInfo) -> Refusal | None:
        from hsx.engine.verify import run_verification

        report = run_verification(self.settings.engine_url, dump_dir=self.settings.dump_dir or info.dump_dir)
        if report.ok:
            return None
        failed = [c for c in report.checks if not c.ok]
        reasons = "; ".join(f"{c.name}: expected {c.expected}, got {c.actual}" for c in failed[:4])
        return self.gate.refuse(engines_met.UNFIT, f"engine failed the preflight check: {reasons}", info)
