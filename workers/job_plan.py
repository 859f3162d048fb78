"""What a wake-up runs a job's units with, resolved once from the job's options, this deployment's settings
and the engine the job is bound to. The unit processor, the unit pipeline and the features read the plan;
none of them reads the options or the settings again, so a unit cannot see a setting its neighbour did not.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsx.contract import EngineInfo, canonical_state_dtype
from hsx.layout import state_tensor_names
from hsx.server.job_options import RegenerateOptions
from hsx.server.settings import Settings
from hsx.streams.contract import CONSUME
from workers.job_view import JobView

# A job's choice for samples longer than max_length (JobOptions.truncation).
TRUNCATE = "truncate"
REJECT = "reject"


def dump_tensors(info: EngineInfo) -> list[str]:
    """The dump tensors a sample keeps, in shard order (hsx.layout.state_tensor_names)."""
    return state_tensor_names(info.hf_indices, info.final_state)


@dataclass(frozen=True)
class JobPlan:
    info: EngineInfo  # the engine the job is bound to, as it answered this wake-up
    dump_dir: str  # where this worker sees the engine's dumps
    dump_wait_seconds: float
    concurrency: int  # prefills (and a regenerate job's generations) in flight
    cache_namespace_per_request: bool
    max_inflight_dump_bytes: int  # dumps captured and not yet streamed into the shard
    max_length: int
    truncation: str  # TRUNCATE or REJECT
    write_behind: int  # shard bytes written ahead of their fsync
    store_fp8: bool  # the shard holds e4m3 codes and per-token scales (schema 3)
    consume: bool  # consume retention: claims wait under the byte cap, acknowledged shards are deleted
    destination: str  # where each committed shard is published ("" for nowhere)
    regenerate: RegenerateOptions | None  # the assistant turns are generated before capture

    def __post_init__(self) -> None:
        if self.truncation not in (TRUNCATE, REJECT):
            raise ValueError(f"truncation must be {TRUNCATE!r} or {REJECT!r}, not {self.truncation!r}")

    @property
    def records_answered(self) -> bool:
        """Whether the records carry their answers; a regenerate job reads prompts and generates them."""
        return self.regenerate is None

    @property
    def state_dtype(self) -> str:
        return canonical_state_dtype(self.info.dtype)

    @property
    def tensors(self) -> list[str]:
        return dump_tensors(self.info)


def resolve_plan(job: JobView, info: EngineInfo, settings: Settings) -> JobPlan:
    options = job.options
    return JobPlan(
        info=info,
        dump_dir=settings.dump_dir or info.dump_dir,
        dump_wait_seconds=settings.dump_wait_seconds,
        concurrency=max(1, settings.engine_concurrency),
        cache_namespace_per_request=options.cache_namespace_per_request,
        max_inflight_dump_bytes=settings.max_inflight_dump_bytes,
        max_length=options.max_length,
        truncation=options.truncation,
        write_behind=settings.shard_write_behind_bytes,
        store_fp8=options.stores_fp8,
        consume=options.retention == CONSUME,
        destination=job.destination,
        regenerate=options.regenerate,
    )
