"""The seam between reading a unit's records and capturing them: a stage a job's options may ask for, that
takes the unit's records (under the unit's lease) and hands capture the records it must take instead.
Regeneration is one (:mod:`workers.regeneration.stage`); a job that asks for none captures its records
as read."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from hsx.server.ingest import Record
from hsx.server.jobs.repository import ClaimedUnit

# (sample index, record, the record's own id)
UnitRecord = tuple[int, Record, str | None]


class RecordStage(Protocol):
    def run(
        self, unit: ClaimedUnit, records: Iterable[UnitRecord], should_stop: Callable[[], bool]
    ) -> Iterable[UnitRecord]:
        """The records capture takes, in sample order. Runs inside the unit's lease; raises
        :class:`workers.unit_processor.UnitAborted` when the lease is lost."""
        ...
