"""What a job's features (:mod:`workers.features`) add to each of its units, collected once per wake-up:

* record stages, between reading a unit's records and capturing them, under the unit's lease (regeneration
  is one: capture takes the texts it kept instead of the records read);
* hooks inside the commit's transaction (:data:`hsx.server.jobs.unit_results.CommitHook`): what they write
  commits with the unit or not at all;
* work after the commit (publication, news of the new item), best effort: the unit is committed whatever it
  does, and what it leaves undone is caught up elsewhere (the reconciler, finalize, a lease's next look).

The unit pipeline runs them; it knows no feature by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hsx.engine.client import EngineClient
from hsx.server.ingest import Record
from hsx.server.jobs.repository import ClaimedUnit
from hsx.server.jobs.unit_results import CommitHook
from hsx.server.settings import Settings
from workers.job_plan import JobPlan

log = logging.getLogger(__name__)

# (sample index, record, the record's own id)
UnitRecord = tuple[int, Record, str | None]

# Runs after the unit's commit landed, outside its lease.
AfterCommit = Callable[[ClaimedUnit], None]


class RecordStage(Protocol):
    def run(
        self, unit: ClaimedUnit, records: Iterable[UnitRecord], should_stop: Callable[[], bool]
    ) -> Iterable[UnitRecord]:
        """The records capture takes, in sample order. Runs inside the unit's lease; raises
        :class:`workers.unit_processor.UnitAborted` when the lease is lost."""
        ...


@dataclass(frozen=True)
class FeatureContext:
    """What a feature may build its stage and hooks from."""

    job_id: str
    settings: Settings
    plan: JobPlan
    client: EngineClient
    tokenizer: Callable[[], Any]  # loaded on first call; raises workers.job_tokenizer.TokenizerMissing


@dataclass
class UnitHooks:
    stages: list[RecordStage] = field(default_factory=list)
    in_transaction: list[CommitHook] = field(default_factory=list)
    after_commit: list[AfterCommit] = field(default_factory=list)

    def staged(
        self, unit: ClaimedUnit, records: Iterable[UnitRecord], should_stop: Callable[[], bool]
    ) -> Iterable[UnitRecord]:
        for stage in self.stages:
            records = stage.run(unit, records, should_stop)
        return records

    def committed(self, unit: ClaimedUnit) -> None:
        """Every after-commit hook, in the order registered; one that fails does not keep the next from
        running, nor undo the commit."""
        for hook in self.after_commit:
            try:
                hook(unit)
            except Exception as exc:  # noqa: BLE001 - the unit is committed; what is left is caught up later
                log.warning("unit %s: after-commit work failed: %s", unit.unit_index, exc)
