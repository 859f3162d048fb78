"""One claimed unit, step by step under its lease: **read** its records, run the **stages** the job's
features added, **capture** them into a staged shard, **commit** it fenced by the attempt; then the
features' after-commit work, outside the lease.

Nothing a step does is visible before the commit: a crash at any point leaves the unit to another attempt,
which starts again from its records (and from what a stage made durable under this lease, such as the texts
regeneration kept). A lease lost before the commit drops the staged shard at once. Errors propagate;
:mod:`workers.unit_attempt` decides what each means for the unit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hsx.engine.client import EngineClient
from hsx.server.faults import crash_point
from hsx.server.ingest import UnitRange, read_unit_records
from hsx.server.jobs.repository import ClaimedUnit
from hsx.server.settings import Settings
from workers import features
from workers.job_plan import JobPlan
from workers.job_view import JobView
from workers.lease import LeaseKeeper
from workers.unit_commit import commit_unit, staged_path
from workers.unit_hooks import FeatureContext, UnitHooks, UnitRecord
from workers.unit_processor import UnitAborted, UnitProcessor, UnitResult

if TYPE_CHECKING:
    from workers.chat import ChatEncoder


@dataclass(frozen=True)
class UnitRun:
    result: UnitResult
    committed: bool  # False: the lease was lost at the commit, nothing was recorded
    commit_s: float
    committed_at: float  # time.monotonic() when the commit returned


class UnitPipeline:
    def __init__(
        self, job: JobView, plan: JobPlan, processor: UnitProcessor, hooks: UnitHooks, settings: Settings
    ) -> None:
        self.records_path = job.records_path
        self.records_bytes = job.records_bytes
        self.record_format = job.options.format
        self.output_dir = job.output_dir
        self.plan = plan
        self.processor = processor
        self.hooks = hooks
        self.settings = settings
        self.db_url = settings.resolved_database_url

    @classmethod
    def build(
        cls,
        job_id: str,
        job: JobView,
        plan: JobPlan,
        client: EngineClient,
        settings: Settings,
        chat: Callable[[], ChatEncoder],
    ) -> UnitPipeline:
        """The job's pipeline, with the stages and hooks of the features its plan asks for."""
        context = FeatureContext(job_id, settings, plan, client, lambda: chat().tokenizer)
        return cls(job, plan, UnitProcessor(client, plan, chat), features.install(context), settings)

    def close(self) -> None:
        self.processor.close()

    def readable(self, unit: ClaimedUnit) -> bool:
        """Whether the unit has a record range to read (a job made before schema 0002 has none)."""
        return unit.byte_start is not None and unit.byte_end is not None and self.records_path is not None

    def run(self, unit: ClaimedUnit) -> UnitRun:
        result = UnitResult()
        keeper = LeaseKeeper(
            self.db_url, unit, self.settings.lease_seconds, self.settings.heartbeat_seconds, result.live
        )
        staged = staged_path(self.output_dir, unit.unit_index, unit.attempt)

        def should_stop() -> bool:
            return keeper.should_stop

        with keeper:
            records = self.read(unit)
            records = self.stages(unit, records, should_stop)
            self.capture(unit, records, staged, should_stop, result)
            crash_point("mid_unit")
            if keeper.should_stop:
                # The shard is whole but will not be committed: it goes now, not at the reconciler's next
                # look at old staged files (after the job may have finished).
                staged.unlink(missing_ok=True)
                raise UnitAborted("stopped before commit")
            committing = time.monotonic()
            committed = self.commit(unit, result)
            committed_at = time.monotonic()
        if committed:
            self.hooks.committed(unit)
        return UnitRun(result, committed, committed_at - committing, committed_at)

    def read(self, unit: ClaimedUnit) -> Iterable[UnitRecord]:
        """The unit's records (only its own bytes of the records file), those of its samples alone."""
        if unit.byte_start is None or unit.byte_end is None or self.records_path is None:
            raise ValueError(f"unit {unit.unit_index} has no record range (see readable)")
        span = UnitRange(unit.sample_start, unit.sample_end, unit.byte_start, unit.byte_end)
        records = read_unit_records(
            self.records_path, self.records_bytes, span, self.record_format, self.plan.records_answered
        )
        return (r for r in records if unit.holds(r[0]))

    def stages(
        self, unit: ClaimedUnit, records: Iterable[UnitRecord], should_stop: Callable[[], bool]
    ) -> Iterable[UnitRecord]:
        return self.hooks.staged(unit, records, should_stop)

    def capture(
        self,
        unit: ClaimedUnit,
        records: Iterable[UnitRecord],
        staged: Path,
        should_stop: Callable[[], bool],
        result: UnitResult,
    ) -> None:
        self.processor.process(unit, records, staged, should_stop, result)

    def commit(self, unit: ClaimedUnit, result: UnitResult) -> bool:
        return commit_unit(self.db_url, unit, result, self.output_dir, hooks=self.hooks.in_transaction)
