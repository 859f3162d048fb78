"""A job's manifest rendered from its rows (the job row and its shard rows): what finalize writes into the
output, and what the API reasons about without opening the output (it may have no view of the workers'
disks)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePath

from hsx.manifest import Counts, Manifest, ManifestError, ShardEntry, job_manifest, relative_shard_path
from hsx.server.db.models import Job, Shard
from hsx.server.job_options import JobOptions


def manifest_of(job: Job, shards: Sequence[Shard], *, on_disk: bool = True) -> Manifest:
    """The manifest of a job whose every unit is done. ``on_disk``: the shard paths are resolved against
    the output directory as the workers' filesystem has them (finalize, on a worker); False renders them
    from the recorded paths alone, touching no file (the API)."""
    out = Path(job.output_dir)
    relative = relative_shard_path if on_disk else _recorded_relative
    return job_manifest(
        job.id,
        job.engine or {},
        fp8=JobOptions.from_stored(job.options).stores_fp8,
        counts=Counts(
            samples=job.samples_done,
            rejected=job.samples_rejected,
            tokens=job.tokens_done,
            truncated=job.samples_truncated,
        ),
        shards=[
            ShardEntry(
                path=relative(out, Path(s.path)),
                sha256=s.sha256,
                bytes=s.bytes,
                samples=s.samples,
                tokens=s.tokens,
                header_sha256=s.header_sha256,
            )
            for s in shards
        ],
        extra={"dataset_uri": job.dataset_uri, "options": dict(job.options)},
    )


def _recorded_relative(manifest_dir: Path, shard_path: Path) -> str:
    try:
        return PurePath(shard_path).relative_to(PurePath(manifest_dir)).as_posix()
    except ValueError:
        raise ManifestError(f"shard {shard_path} lies outside {manifest_dir}") from None
