"""What a job runner reads of a job row once per wake-up, and what it tells its caller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hsx.server.db.models import Job
from hsx.server.job_options import JobOptions
from hsx.server.jobs.publication import destination_of
from hsx.server.settings import Settings


@dataclass
class Outcome:
    summary: str
    more_work: bool
    timing: dict[str, float] | None = None  # a committed unit's (UnitResult's fields; commit_s, tail_s)


@dataclass(frozen=True)
class JobView:
    """What a runner needs of the job row, read once per wake-up."""

    state: str
    options: JobOptions  # the unit size resolved against this deployment's default
    engine: dict[str, Any] | None
    dataset_path: str
    output_dir: str
    records_path: str | None
    records_bytes: int | None
    units_total: int
    destination: str  # where its shards are published as units commit ("" for nowhere)

    @classmethod
    def of(cls, job: Job, settings: Settings) -> JobView:
        return cls(
            job.state,
            JobOptions.from_stored(job.options, settings.samples_per_shard),
            job.engine,
            job.dataset_path,
            job.output_dir,
            job.records_path,
            job.records_bytes,
            job.units_total,
            destination_of(job, settings),
        )
